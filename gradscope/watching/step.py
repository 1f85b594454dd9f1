"""What :func:`gradscope.watch` checks at the end of a backward, and how it words what it finds.

Pure helpers over plain values: the guard in :mod:`gradscope.watch` owns the hooks and calls these.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from gradscope._torch import foreach_norm, sparse_values
from gradscope.findings import Finding

__all__ = ["WatchedParam", "nonfinite", "none_grad_findings", "nonfinite_findings", "error_message",
           "rank_text"]

_LIST_AT_MOST = 12


class WatchedParam(NamedTuple):
    """A watched parameter, with the module that owns it (resolved once, when ``watch`` starts)."""

    name: str
    param: torch.Tensor
    module: str          # qualified module name; "" for the root module
    module_type: str     # class name of that module


class BadGrad(NamedTuple):
    """A gradient that holds NaN or Inf: counts from the error path only."""

    wp: WatchedParam
    nan: int
    inf: int
    numel: int


def nonfinite(watched: list[WatchedParam]) -> list[BadGrad]:
    """Which of these parameters' ``.grad`` hold NaN or Inf, in one batched pass.

    Every gradient is reduced to one float32 number that is NaN or Inf when the gradient holds one (a sum
    on CPU, ``torch._foreach_norm`` elsewhere); the numbers are stacked and tested with one
    ``isfinite().all()`` and one ``.item()`` per device, so the healthy path costs one read of the gradients
    and a single sync, not one synchronising call per tensor. (On CPU, for a 4M-parameter model: sum
    1.1 ms, 2-norm 1.5 ms, ``ord=inf`` norm 28 ms.) Only when that says "not finite" are the culprits
    counted; a reduction that overflowed float32 on finite values is dropped there, as the counts are the
    ground truth.
    """
    groups: dict[torch.device, tuple[list, list]] = {}
    for wp in watched:
        g = wp.param.grad
        if g is None:
            continue
        if g.is_sparse:
            g = sparse_values(g)
        if g.numel() == 0:
            continue
        wps, grads = groups.setdefault(g.device, ([], []))
        wps.append(wp)
        grads.append(g)
    bad: list[BadGrad] = []
    for wps, grads in groups.values():
        if grads[0].device.type == "cpu":       # CPU foreach ops loop per tensor anyway; a sum reads fastest
            stacked = torch.stack([g.sum(dtype=torch.float32) for g in grads])
        else:                                   # one fused multi-tensor kernel on accelerators
            stacked = torch.stack(foreach_norm(grads, 2, dtype=torch.float32))
        if bool(stacked.isfinite().all().item()):
            continue
        for wp, g, m in zip(wps, grads, stacked.tolist()):
            if not math.isfinite(m):
                nan, inf = int(torch.isnan(g).sum().item()), int(torch.isinf(g).sum().item())
                if nan or inf:
                    bad.append(BadGrad(wp, nan, inf, g.numel()))
    return bad


def rank_text() -> str:
    """``"rank 1 of 2"`` inside an initialised process group, else ``""``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return f"rank {dist.get_rank()} of {dist.get_world_size()}"
    return ""


def _where(wp: WatchedParam) -> str:
    return f"module {wp.module!r}, {wp.module_type}" if wp.module else f"the root module, {wp.module_type}"


_NONE_CAUSES = ("Likely causes: the module's output did not reach the loss on this step (a branch skipped "
                "by control flow, an unused head, an expert no token was routed to), the forward cut the "
                "graph "
                "(.detach(), .data, torch.no_grad(), .item()/.numpy(), an integer op such as argmax), or a "
                "custom autograd.Function whose backward returned None for this input.")
_NONE_NEXT = ("Next step: run the forward under `with gradscope.trace() as tr:` and call "
              "`gradscope.inspect(loss, model=model, trace=tr)` before backward: it names the op and the "
              "file:line that cut the graph. If the parameter is legitimately unused on some steps, pass "
              "watch(model, ignore=[...]) with its name or a pattern, or freeze it with "
              "requires_grad_(False).")
_DDP_NOTE = ("DistributedDataParallel(find_unused_parameters=False) will fail at the next forward with "
             "\"Expected to have finished reduction in the prior iteration\": make every parameter take "
             "part in the loss, or pass find_unused_parameters=True.")
_NAN_CAUSES = ("Likely causes: an op whose derivative is infinite at the value it saw (sqrt or pow(x, 0.5) "
               "at 0, log at 0, division by zero), an overflow (exploding gradients, float16 without a "
               "GradScaler), or a NaN already present in the input or the loss.")
_NAN_NEXT = ("Next step: run one step under torch.autograd.set_detect_anomaly(True): it names the backward "
             "op that first produced the NaN and the forward line that created it; then guard that op "
             "(x.clamp_min(eps).sqrt(), torch.log(x + eps)) or clip the gradients.")


def none_grad_findings(missing: list[WatchedParam], context: str, ddp_strict: bool) -> list[Finding]:
    """One ``none-grad`` finding per parameter that received no gradient in the checked backward(s)."""
    out = []
    for wp in missing:
        stale = (" Its .grad still holds a value from an earlier step (zero_grad(set_to_none=False)), which "
                 "the optimizer would apply again." if wp.param.grad is not None else "")
        ddp = " " + _DDP_NOTE if ddp_strict else ""
        out.append(Finding("none-grad", "error",
                           f"Parameter {wp.name!r} ({_where(wp)}) received no gradient {context}.{stale} "
                           f"{_NONE_CAUSES} {_NONE_NEXT}{ddp}", params=(wp.name,)))
    return out


def _values_text(b: BadGrad) -> str:
    parts = [f"{n} {what}" for n, what in ((b.nan, "NaN"), (b.inf, "Inf")) if n]
    return " and ".join(parts) + f" of {b.numel} values"


def nonfinite_findings(bad: list[BadGrad], context: str, scale: float | None) -> list[Finding]:
    """One ``nonfinite-grad`` finding per gradient holding NaN or Inf."""
    scaler = (f" The GradScaler has already lowered its scale to {scale:g} and the gradients are still not "
              f"finite, so this is not a float16 overflow from loss scaling." if scale is not None else "")
    return [Finding("nonfinite-grad", "error",
                    f"The gradient of {b.wp.name!r} ({_where(b.wp)}) holds {_values_text(b)} {context}."
                    f"{scaler} {_NAN_CAUSES} {_NAN_NEXT}", params=(b.wp.name,))
            for b in bad]


def _names(items: list[WatchedParam], extra=None) -> str:
    shown = [f"{wp.name} ({_where(wp)}{extra(i) if extra else ''})"
             for i, wp in enumerate(items[:_LIST_AT_MOST])]
    more = f", and {len(items) - _LIST_AT_MOST} more" if len(items) > _LIST_AT_MOST else ""
    return "; ".join(shown) + more


def error_message(missing: list[WatchedParam], bad: list[BadGrad], context: str, ddp_strict: bool,
                  scale: float | None) -> str:
    """The text of the :class:`~gradscope.GradientError`: every offending parameter, causes, next step."""
    parts = [f"gradscope.watch: problems {context}:"]
    if missing:
        n = len(missing)
        stale = sum(wp.param.grad is not None for wp in missing)
        stale_text = (f" {stale} of them still hold{'s' if stale == 1 else ''} a .grad from an earlier "
                      f"step (zero_grad(set_to_none=False)), which the optimizer would apply again."
                      if stale else "")
        parts.append(f"- {n} parameter{'s' if n > 1 else ''} with requires_grad=True received no gradient: "
                     f"{_names(missing)}.{stale_text} {_NONE_CAUSES} {_NONE_NEXT}"
                     + (f" {_DDP_NOTE}" if ddp_strict else ""))
    if bad:
        n = len(bad)
        scaler = (f" The GradScaler's scale is already down to {scale:g}, so this is not a float16 overflow "
                  f"from loss scaling." if scale is not None else "")
        parts.append(f"- {n} gradient{'s' if n > 1 else ''} hold{'' if n > 1 else 's'} NaN or Inf: "
                     f"{_names([b.wp for b in bad], lambda i: ': ' + _values_text(bad[i]))}.{scaler} "
                     f"{_NAN_CAUSES} {_NAN_NEXT}")
    return "\n".join(parts)
