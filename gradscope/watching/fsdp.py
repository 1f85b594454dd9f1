"""Watching a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

NOTE [FSDP2]
After ``fully_shard`` every parameter is a sharded ``DTensor``; the forward runs on unsharded copies, and
FSDP2 writes the reduce-scattered gradient into the sharded parameter's ``.grad`` itself, so the
parameter hooks of NOTE [end of backward] never fire. For such a model the guard instead (1) notes, at
each forward of the watched model, every sharded ``.grad``'s local tensor and version, (2) puts a pre-hook
on each output's ``grad_fn`` that queues the end-of-backward callback (queued after FSDP2's own final
callback, which waits for the reduce-scatter), and (3) at the end of the backward counts a parameter as
"received a gradient" when its ``.grad`` is new or its version moved. NaN/Inf and the norms are computed
on each rank's local shard, so a NaN is reported by the rank that holds it.
"""

from __future__ import annotations

import torch

from gradscope._torch import current_graph_task_id, queue_engine_callback, version
from gradscope._wrappers import is_fsdp2

__all__ = ["is_fsdp2", "FsdpStamps"]


def _key(grad):
    if grad is None:
        return None
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    return id(local), version(local)


class FsdpStamps:
    def __init__(self, guard):
        self._guard = guard
        self._before: list = []

    def forward(self, outs) -> None:
        """At a forward of the watched model: note the gradients, arm the end-of-backward callback."""
        guard = self._guard
        if not self._before:
            self._before = [_key(wp.param.grad) for wp in guard._params]

        def queue(_grad_outputs):
            tid = current_graph_task_id()
            if tid not in guard._pending and not guard._removed:
                guard._pending.add(tid)
                queue_engine_callback(guard._on_end)

        for fn in outs:
            fn.register_prehook(queue)

    def stamp(self, tid: int) -> None:
        """At the end of a backward: stamp the parameters whose ``.grad`` changed since the forward."""
        before, self._before = self._before, []
        for i, wp in enumerate(self._guard._params):
            now = _key(wp.param.grad)
            if now is not None and (i >= len(before) or now != before[i]):
                self._guard._stamp[i] = tid


def local_grad(grad) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad
