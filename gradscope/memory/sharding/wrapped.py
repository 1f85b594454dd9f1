"""The spec of a model already wrapped on a rank: ``DistributedDataParallel`` or ``fully_shard``-ed (FSDP2).

``inspect(loss, model=m)`` on a rank reads how ``m`` was wrapped into a plain :class:`DDP` / :class:`FSDP`
and the rank it runs on, so that ``report.what_if(optimizer=opt)`` predicts the same per-rank step as
``what_if(shard=spec)`` on the unsharded model. FSDP2's settings are read from its parameter groups (torch
2.13's ``_get_fsdp_state()``: docs/internals.md#fsdp2s-settings-on-a-wrapped-model); the unsharded
parameters the forward ran on are named after the sharded ones, so the graph's parameters are the unsharded
model's (``walk/named.py``).
"""

from __future__ import annotations

from gradscope._torch import fsdp2_groups, fsdp2_mp_policy
from gradscope._wrappers import is_fsdp2
from gradscope.errors import InputValueError
from gradscope.memory.sharding.specs import DDP, FSDP

__all__ = ["wrapped_spec"]


def _reshard(group) -> bool | int:
    post = group.post_forward_mesh_info
    if post is None:
        return False
    if post is group.mesh_info or post.shard_mesh_size == group.mesh_info.shard_mesh_size:
        return True
    return int(post.shard_mesh_size)


def wrapped_spec(model) -> tuple[DDP | FSDP, int] | None:
    """``(spec, rank)`` of a DDP model or of an FSDP2 one (``fully_shard`` on the root), None otherwise.

    Raises:
        InputValueError: the wrapping has no spec (FSDP2 modules nested in one another, or with different
            settings; only the root ``fully_shard``-ed).
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        import torch.distributed as dist

        pg = model.process_group
        ddp = DDP(
            dist.get_world_size(pg),
            gradient_as_bucket_view=bool(model.gradient_as_bucket_view),
            bucket_cap_mb=model.bucket_bytes_cap / 2**20,
        )
        return ddp, dist.get_rank(pg)
    if not is_fsdp2(model):
        return None
    named = [(n, m) for n, m in model.named_modules() if is_fsdp2(m)]
    inner = [n for n, _ in named if n]
    if not inner:
        raise InputValueError(
            "model= is fully_shard-ed at its root only: gradscope.FSDP shards modules before the root; predict "
            "it from the unsharded model with modules= naming them."
        )
    nested = [n for n in inner if any(n.startswith(o + ".") for o in inner)]
    if nested:
        raise InputValueError(
            f"model= has fully_shard-ed modules inside others ({nested[0]!r}): gradscope.FSDP shards the "
            "outermost only; predict it from the unsharded model with modules= naming those."
        )
    settings = set()
    for _, m in named[1:]:
        for g, _ in fsdp2_groups(m):
            settings.add((_reshard(g), fsdp2_mp_policy(g), type(g.offload_policy).__name__))
    root = ([g for g, _ in fsdp2_groups(model)] or [g for _, m in named[1:] for g, _ in fsdp2_groups(m)])[0]
    if len(settings) > 1:
        raise InputValueError(
            f"model='s fully_shard-ed modules differ in reshard_after_forward / mp_policy / offload_policy "
            f"({len(settings)} settings); gradscope.FSDP takes one setting for all of them."
        )
    reshard, mp, _ = settings.pop() if settings else (True, fsdp2_mp_policy(root), "")
    mp = mp if getattr(mp, "param_dtype", None) is not None else None
    off = root.offload_policy if type(root.offload_policy).__name__ == "CPUOffloadPolicy" else None
    mesh = root.mesh_info
    spec = FSDP(
        int(mesh.shard_mesh_size),
        modules=tuple(inner),
        reshard_after_forward=reshard,
        mp_policy=mp,
        offload_policy=off,
    )
    return spec, int(mesh.shard_mesh_rank)
