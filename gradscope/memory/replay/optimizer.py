"""The memory of ``optimizer.step()``: state it creates on the first step and the temporaries of the update.

NOTE [optimizer step memory]
Read from torch 2.13's ``torch/optim`` and checked against torch.profiler on CPU. Only parameters with a
``.grad`` after backward are touched. State is created lazily at the first ``step()`` and then kept:
SGD with momentum: ``momentum_buffer = clone(grad)`` (inside the update loop); Adam/AdamW:
``exp_avg``, ``exp_avg_sq`` (``max_exp_avg_sq`` with amsgrad) and a 4-byte ``step`` tensor, all in
``_init_group`` before the loop. Temporaries of the single-tensor loop (CPU default): Adam/AdamW build
``denom = (exp_avg_sq.sqrt() / c).add_(eps)`` (two parameter-sized tensors, the first freed at once; the
previous parameter's ``denom`` lives until it is rebound), ``grad.add(param, alpha=wd)`` for Adam's
weight decay, ``-grad`` with ``maximize``. On CUDA the default is the foreach implementation, which
makes the same temporaries for all parameters of a group at once. In the single-tensor loop the Python
scalar ``c`` is an operand too: torch wraps it in a 0-dim float64 tensor (8 B) and casts that to the
parameter's dtype, both alive while ``denom`` is made (measured: the step's peak is 12 B above two float32
parameter-sized tensors, the same with FSDP2's sharded parameters). Other optimizers use a table of state
tensors per parameter and one parameter-sized temporary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradscope._torch import storage_key
from gradscope.graph import PARAMS
from gradscope.memory.replay.engine import numel_bytes

__all__ = ["StepBudget", "step_budget"]

#: A Python scalar operand wrapped into a 0-dim float64 tensor (NOTE [optimizer step memory]).
_SCALAR = 8

#: Optimizer class name -> state tensors per parameter (others: 2).
_STATE = {
    **dict.fromkeys(("RMSprop", "Adagrad"), 1),
    **dict.fromkeys(("Adamax", "NAdam", "RAdam", "Adadelta", "Rprop", "ASGD", "SparseAdam"), 2),
    "LBFGS": 0,
}


@dataclass
class StepBudget:
    """``optimizer.step()``: bytes of state before it, state it creates, its peak and end relative to the
    level at which it starts."""

    name: str
    params: int  # parameters it updates
    state_before: int  # optimizer state of earlier steps
    state_new: int  # state created by this step (kept)
    peak: int  # highest level during the step, relative to its start
    end: int  # level after the step (= state_new)
    implementation: str  # "single-tensor" | "foreach" | "estimate"


def _nbytes(p) -> int:
    return p.numel() * p.element_size()


def _state_bytes(opt) -> int:
    seen, total = set(), 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                try:
                    key = storage_key(v)
                except (RuntimeError, NotImplementedError):
                    key = id(v)
                if key not in seen:
                    seen.add(key)
                    total += _nbytes(v)
    return total


def step_budget(opt, graph=None, *, has_grad_names=(), after: int = 0, target=None, later: bool = False) -> StepBudget:
    """Predict ``opt.step()`` after the replayed backward (see NOTE [optimizer step memory]).

    A parameter is updated when it has a ``.grad`` now or the graph reaches it (by identity when the
    graph recorded it, else by shape). ``target`` (a device target, NOTE [device targets]) sets the
    default implementation and how each state tensor is rounded; Adam's ``step`` counters then stay on the
    CPU, as torch keeps them there off the CPU unless ``capturable`` or ``fused``. ``later=True``: a step
    after the first (replay/steady.py NOTE [first and later steps]): every updated parameter's state exists.
    """
    alloc = int if target is None else target.allocated
    reached = _reached(graph)
    kind = type(opt).__name__
    level = peak = new_state = 0
    count = 0
    impl = "estimate"
    for group in opt.param_groups:
        params = [p for p in group["params"] if p.grad is not None or id(p) in reached]
        count += len(params)
        sizes = [alloc(_nbytes(p)) for p in params]
        fresh = [not later and len(opt.state.get(p, {})) == 0 for p in params]
        on_device = target.foreach if target is not None else None
        if on_device is None:
            on_device = bool(params) and params[0].device.type not in ("cpu", "meta")
        foreach = bool(group.get("foreach")) or (group.get("foreach") is None and on_device)
        on_cpu = target is None or target.name == "cpu"
        step_bytes = alloc(4) if on_cpu or group.get("capturable") or group.get("fused") else 0
        if isinstance(opt, torch.optim.Adam):  # AdamW subclasses Adam
            impl = "foreach" if foreach else "single-tensor"
            per = 3 if group.get("amsgrad") else 2
            for n, f in zip(sizes, fresh):
                if f:
                    new_state += per * n + step_bytes
                    level += per * n + step_bytes
            peak = max(peak, level)
            wd_temp = group.get("weight_decay", 0) and not getattr(opt, "_gs_decoupled", kind == "AdamW")
            if group.get("decoupled_weight_decay"):
                wd_temp = False
            neg = bool(group.get("maximize"))
            if foreach:
                total = sum(sizes)
                temps = total * (1 + int(bool(wd_temp)) + int(neg))
                peak = max(peak, level + temps + total)
            else:
                prev = 0
                for n, p in zip(sizes, params):
                    t = n * (int(bool(wd_temp)) + int(neg)) + _SCALAR + p.element_size()
                    peak = max(peak, level + prev + t + 2 * n)
                    prev = n
        elif isinstance(opt, torch.optim.SGD):
            impl = "foreach" if foreach else "single-tensor"
            mom = group.get("momentum", 0)
            wd = group.get("weight_decay", 0)
            for n, f in zip(sizes, fresh):
                t = n if (wd or group.get("maximize")) else 0
                if mom and f:
                    level += n
                    new_state += n
                if mom and group.get("nesterov"):
                    t += n
                peak = max(peak, level + t)
        else:
            per = _STATE.get(kind, 2)
            for n, f in zip(sizes, fresh):
                if f:
                    level += per * n
                    new_state += per * n
            peak = max(peak, level + max(sizes, default=0))
    return StepBudget(kind, count, _state_bytes(opt), new_state, max(peak, level), level, impl)


def _reached(graph) -> set:
    if graph is None:
        return set()
    out = set()
    for p in graph.graph.get(PARAMS, {}).values():
        if p.get("node") is not None and p.get("requires_grad") and p.get("pid") is not None:
            out.add(p["pid"])
    for _, d in graph.nodes(data=True):  # parameters inside a reentrant checkpoint get grads too
        for entry in (d.get("attrs") or {}).get("region_params") or ():
            if len(entry) > 3:
                out.add(entry[3])
    return out


def shapes_bytes(shapes_dtypes) -> int:
    """Sum of dense bytes of ``[(shape, dtype)]``."""
    return sum(numel_bytes(s, d) for s, d in shapes_dtypes)
