"""``optimizer.step()`` on one rank's shards: the single-process rules (NOTE [optimizer step memory]) applied
to an optimizer of the same class and settings over meta tensors shaped like the rank's local shards."""

from __future__ import annotations

import torch

from gradscope.graph import PARAMS
from gradscope.memory.replay.optimizer import StepBudget, step_budget
from gradscope.memory.sharding.layout import shard_rows

__all__ = ["sharded_step"]


def _local(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    shape = list(t.shape)
    if shape:
        shape[0] = shard_rows(shape[0], world, rank)
    return torch.empty(shape, dtype=t.dtype, device="meta")


def sharded_step(optimizer, graph, world: int, rank: int, later: bool = False) -> StepBudget | None:
    """The step budget of ``optimizer`` on rank ``rank``'s local shards (None without an optimizer);
    ``later``: a step after the first, every updated shard's state alive (replay/steady.py NOTE [first
    and later steps])."""
    if optimizer is None:
        return None
    params = graph.graph.get(PARAMS, {})
    reached = {p.get("pid") for p in params.values() if p.get("node") is not None and p.get("requires_grad")}
    groups = []
    state: dict = {}
    for group in optimizer.param_groups:
        metas = []
        for p in group["params"]:
            m = _local(p, world, rank).requires_grad_(p.requires_grad)
            if p.grad is not None or id(p) in reached:
                m.grad = torch.empty_like(m)
            st = optimizer.state.get(p)
            if st:
                state[m] = {
                    k: _local(v, world, rank) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                    for k, v in st.items()
                }
            metas.append(m)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": metas})
    meta_opt = type(optimizer)(groups)
    meta_opt.state.update(state)
    return step_budget(meta_opt, None, later=later)
