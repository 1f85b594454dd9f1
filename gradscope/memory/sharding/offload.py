"""FSDP2's ``CPUOffloadPolicy``: what stays on the host, and what the device still holds.

NOTE [FSDP2 CPU offload]
Read from torch 2.13's ``torch/distributed/fsdp/_fully_shard`` (``_fsdp_param.py``, ``_fsdp_collectives.py``)
and checked per rank on gloo (tests/memory/test_sharding.py). With ``offload_policy=CPUOffloadPolicy()``
each padded shard is moved to the host when ``fully_shard`` runs (pinned by default), the sharded gradients
are copied there after each reduce-scatter, and ``optimizer.step()`` runs there with its state. The device
keeps the buffers, the inputs, the activations and FSDP2's working set: before each all-gather every shard
of the group is copied to the device (``.to(device)``), copied into the flat output and dropped; after each
reduce-scatter the group's sharded gradients (views into one flat output of a padded shard) are copied to
the host, each its unpadded rows, and the output is dropped on the device. A
group resharded to a smaller mesh after forward (``reshard_after_forward=int``) keeps those shards on the
device, so its backward all-gather copies nothing from the host.

On a CPU-only run the device *is* the host: ``.to("cpu")`` of a CPU tensor returns the tensor itself, so
offloading moves nothing and the step's memory is the step's without offload (measured: the same per-rank
peaks on gloo). The prediction then says so: ``ranks`` is the whole rank's memory, and ``host_parts`` the
bytes of it that live on the host when the step runs on an accelerator. With an accelerator (a step
traced on ``meta`` or ``cuda``), ``ranks`` is the device's peak and ``host_parts`` the host's, each on its
own; the device side is modelled, not measured (no accelerator has run the check). Pinning needs an
accelerator (torch refuses ``pin_memory()`` without one), so a CPU-only run uses
``CPUOffloadPolicy(pin_memory=False)``; pinned blocks are counted at their tensors' size.
"""

from __future__ import annotations

from gradscope.memory.sharding.layout import Group
from gradscope.memory.sharding.specs import FSDP

__all__ = ["host_parts", "offload_notes"]

HOST_PARAMS = "sharded parameters (padded)"


def host_parts(gs: list[Group], grads: dict[str, int], rank: int | None, state: int, step) -> dict[str, int]:
    """A rank's host memory at its peak under CPU offload, by kind: the padded shards, the sharded gradients
    of the groups backward reaches, the optimizer state and the step's own peak above them. ``rank``: the
    rank whose gradients are copied to the host (its unpadded rows); None on the CPU, where each group's
    gradients stay views into its padded reduce-scatter output."""
    out = {
        HOST_PARAMS: sum(g.padded for g in gs),
        "gradients (sharded)": sum(g.padded if rank is None else g.local[rank] for g in gs if grads.get(g.name)),
        "optimizer state (before the step)": state,
    }
    if step is not None:
        out[f"{step.name}.step() above its start"] = max(0, step.peak)
    return out


def offload_notes(spec: FSDP, device: str) -> list[str]:
    """What the prediction means under ``spec``'s offload policy on ``device`` (none without one)."""
    if not spec.offload:
        return []
    if device == "cpu":
        return [
            "CPU offload on the CPU: the device is the host (copies to the CPU return the tensor itself), so the "
            "per-rank peak is the whole step's, as without offload; 'host' lists what stays on the host when "
            "the step runs on an accelerator"
        ]
    return [
        "CPU offload: sharded parameters, gradients, optimizer state and optimizer.step() on the host ('host'); "
        "the per-rank peak is the device's, with each shard copied in before its all-gather and each sharded "
        "gradient copied out: modelled, not measured"
    ]
