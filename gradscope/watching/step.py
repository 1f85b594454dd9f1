"""What :func:`gradscope.watch` checks at the end of a backward, and how it words what it finds.

Pure helpers over plain values: the guard in :mod:`gradscope.watch` owns the hooks and calls these.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gradscope.findings import ERROR, NONE_GRAD, NONFINITE_GRAD, Finding, sort_findings

__all__ = [
    "WatchedParam",
    "BadGrad",
    "none_grad_findings",
    "nonfinite_findings",
    "error_message",
    "rank_text",
    "birth_text",
    "check_report",
    "where_text",
    "SEVERAL_BACKWARDS",
]

_LIST_AT_MOST = 12


class WatchedParam(NamedTuple):
    """A watched parameter, with the module that owns it (resolved once, when ``watch`` starts)."""

    name: str
    param: torch.Tensor
    module: str  # qualified module name; "" for the root module
    module_type: str  # class name of that module


class BadGrad(NamedTuple):
    """A gradient that holds NaN or Inf: counts from the error path only."""

    wp: WatchedParam
    nan: int
    inf: int
    numel: int


def rank_text() -> str:
    """``"rank 1 of 2"`` inside an initialised process group, else ``""``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return f"rank {dist.get_rank()} of {dist.get_world_size()}"
    return ""


def where_text(wp: WatchedParam) -> str:
    """``module 'enc', Linear``: where a watched parameter lives."""
    return f"module {wp.module!r}, {wp.module_type}" if wp.module else f"the root module, {wp.module_type}"


_NONE_CAUSES = (
    "Likely causes: the module's output did not reach the loss on this step (a branch skipped "
    "by control flow, an unused head, an expert no token was routed to), the forward cut the "
    "graph "
    "(.detach(), .data, torch.no_grad(), .item()/.numpy(), an integer op such as argmax), or a "
    "custom autograd.Function whose backward returned None for this input."
)
_NONE_NEXT = (
    "Next step: run the forward under `with gradscope.trace() as tr:` and call "
    "`gradscope.inspect(loss, model=model, trace=tr)` before backward: it names the op and the "
    "file:line that cut the graph. If the parameter is legitimately unused on some steps, pass "
    "watch(model, ignore=[...]) with its name or a pattern, or freeze it with "
    "requires_grad_(False)."
)
#: Said with a none-grad judged per backward: several backwards per optimizer step is the usual cause.
SEVERAL_BACKWARDS = (
    "If one optimizer step follows several backwards (a GAN whose generator and discriminator live in one "
    "module, one loss per task with retain_graph=True, gradient accumulation), this is expected: pass "
    "watch(model, accumulate=N) with N backwards per step, or step an optimizer that holds these parameters "
    "(watch() then judges at optimizer.step())."
)
_DDP_NOTE = (
    "DistributedDataParallel(find_unused_parameters=False) will fail at the next forward with "
    '"Expected to have finished reduction in the prior iteration": make every parameter take '
    "part in the loss, or pass find_unused_parameters=True."
)
_NAN_CAUSES = (
    "Likely causes: an op whose derivative is infinite at the value it saw (sqrt or pow(x, 0.5) "
    "at 0, log at 0, division by zero), an overflow (exploding gradients, float16 without a "
    "GradScaler), or a NaN already present in the input or the loss."
)
_NAN_NEXT = (
    "Next step: run one step under torch.autograd.set_detect_anomaly(True): it names the backward "
    "op that first produced the NaN and the forward line that created it; then guard that op "
    "(x.clamp_min(eps).sqrt(), torch.log(x + eps)) or clip the gradients."
)
_ARMED = (
    "gradscope has armed per-node checks for the next backward of this model: if it is not finite "
    "either, the finding names the backward op where the first non-finite value was born, its module "
    "and forward line (with on_error='raise', catch this error and run one more step). Or run one "
    "step under torch.autograd.set_detect_anomaly(True), which names the first op that returned NaN."
)


def birth_text(birth) -> str:
    """Where the first non-finite value was born (an :class:`~gradscope.watching.origin.Birth`)."""
    if birth.op == "the forward":
        anomaly = (
            f" (torch.autograd.detect_anomaly() would name {birth.nan_op}, the first backward op that returned "
            f"NaN, since the loss it starts from is not finite already)"
            if birth.nan_op
            else ""
        )
        if birth.cause.startswith("The loss itself is"):  # NOTE [a non-finite loss]: say that first
            return f"{birth.cause} The non-finite value was born in the forward, before backward{anomaly}."
        return f"The non-finite value was born in the forward, before backward{anomaly}. {birth.cause}"
    module = (
        f"in module {birth.module!r}"
        if birth.module
        else "in the watched model's own forward"
        if birth.module == ""
        else None
    )
    where = ", ".join(x for x in (module, (f"at {birth.location}" if birth.location else None)) if x)
    nan = (
        f"; it first became NaN in {birth.nan_op}, the op torch.autograd.detect_anomaly() names"
        if birth.nan_op and birth.nan_op != birth.op
        else ""
    )
    return (
        f"The first non-finite value was born in the backward op {birth.op}"
        + (f" ({where})" if where else "")
        + f"{nan}. {birth.cause}"
    )


def none_grad_findings(
    missing: list[WatchedParam], context: str, ddp_strict: bool, hint: str = "", causes: dict | None = None
) -> list[Finding]:
    """One ``none-grad`` finding per parameter that received no gradient in the checked backward(s);
    ``causes``: module name -> the known cause (it replaces the list of likely causes)."""
    out = []
    for wp in missing:
        known = (causes or {}).get(wp.module)
        stale = (
            " Its .grad still holds a value from an earlier step (zero_grad(set_to_none=False)), which "
            "the optimizer would apply again."
            if wp.param.grad is not None
            else ""
        )
        ddp = " " + _DDP_NOTE if ddp_strict else ""
        out.append(
            Finding(
                NONE_GRAD,
                ERROR,
                f"Parameter {wp.name!r} ({where_text(wp)}) received no gradient {context}.{stale} "
                + (known or f"{_NONE_CAUSES} {_NONE_NEXT}{hint and ' ' + hint}")
                + ddp,
                params=(wp.name,),
            )
        )
    return out


def _values_text(b: BadGrad) -> str:
    parts = [f"{n} {what}" for n, what in ((b.nan, "NaN"), (b.inf, "Inf")) if n]
    return " and ".join(parts) + f" of {b.numel} values"


def _nan_tail(birth, armed) -> str:
    if birth is not None:
        return birth_text(birth)
    return f"{_NAN_CAUSES} {_ARMED if armed else _NAN_NEXT}"


def nonfinite_findings(bad: list[BadGrad], context: str, scale: float | None, birth=None, armed=False) -> list[Finding]:
    """One ``nonfinite-grad`` finding per gradient holding NaN or Inf."""
    scaler = (
        f" The GradScaler has already lowered its scale to {scale:g} and the gradients are still not "
        f"finite, so this is not a float16 overflow from loss scaling."
        if scale is not None
        else ""
    )
    tail = _nan_tail(birth, armed)
    location = birth.location if birth is not None else None
    return [
        Finding(
            NONFINITE_GRAD,
            ERROR,
            f"The gradient of {b.wp.name!r} ({where_text(b.wp)}) holds {_values_text(b)} {context}.{scaler} {tail}",
            params=(b.wp.name,),
            location=location,
        )
        for b in bad
    ]


def _names(items: list[WatchedParam], extra=None) -> str:
    shown = [f"{wp.name} ({where_text(wp)}{extra(i) if extra else ''})" for i, wp in enumerate(items[:_LIST_AT_MOST])]
    more = f", and {len(items) - _LIST_AT_MOST} more" if len(items) > _LIST_AT_MOST else ""
    return "; ".join(shown) + more


def error_message(
    missing: list[WatchedParam],
    bad: list[BadGrad],
    context: str,
    ddp_strict: bool,
    scale: float | None,
    birth=None,
    armed=False,
    hint: str = "",
    causes: dict | None = None,
) -> str:
    """The text of the :class:`~gradscope.GradientError`: every offending parameter, causes, next step."""
    parts = [f"gradscope.watch: problems {context}:"]
    if missing:
        n = len(missing)
        stale = sum(wp.param.grad is not None for wp in missing)
        stale_text = (
            f" {stale} of them still hold{'s' if stale == 1 else ''} a .grad from an earlier "
            f"step (zero_grad(set_to_none=False)), which the optimizer would apply again."
            if stale
            else ""
        )
        why = causes or {}
        known = list(dict.fromkeys(why[wp.module] for wp in missing if wp.module in why))
        generic = not all(wp.module in why for wp in missing)
        parts.append(
            f"- {n} parameter{'s' if n > 1 else ''} with requires_grad=True received no gradient: "
            f"{_names(missing)}.{stale_text} "
            + " ".join(known + ([_NONE_CAUSES, _NONE_NEXT] if generic else []))
            + (f" {hint}" if hint and generic else "")
            + (f" {_DDP_NOTE}" if ddp_strict else "")
        )
    if bad:
        n = len(bad)
        scaler = (
            f" The GradScaler's scale is already down to {scale:g}, so this is not a float16 overflow "
            f"from loss scaling."
            if scale is not None
            else ""
        )
        parts.append(
            f"- {n} gradient{'s' if n > 1 else ''} hold{'' if n > 1 else 's'} NaN or Inf: "
            f"{_names([b.wp for b in bad], lambda i: ': ' + _values_text(bad[i]))}.{scaler} "
            f"{_nan_tail(birth, armed)}"
        )
    return "\n".join(parts)


def check_report(missing, bad, n, backwards, ddp_strict, scale, birth, armed, late, causes=None) -> tuple:
    """``(findings, message, quiet message)`` of a check at the end of ``n`` backwards (the last is number
    ``backwards``): the error's text names the step, the warned one does not (NOTE in
    :mod:`gradscope.watching.quiet`)."""
    rank = rank_text()
    where = (
        f"in this backward (backward {backwards}"
        if n == 1
        else f"in the accumulation window of {n} backwards ending at backward {backwards}"
    )
    stable = "in a backward" if n == 1 else f"in an accumulation window of {n} backwards"
    context = where + (f", {rank})" if rank else ")")
    hint = SEVERAL_BACKWARDS if n == 1 else ""
    findings = sort_findings(
        none_grad_findings(missing, context, ddp_strict, hint, causes)
        + nonfinite_findings(bad, context, scale, birth, armed)
        + list(late)
    )
    message = error_message(missing, bad, context, ddp_strict, scale, birth, armed, hint, causes) + "".join(
        f"\n- {f.kind} ({f.severity}): {f.message}" for f in late if f.severity == ERROR
    )
    quiet = error_message(
        missing, bad, stable + (f" ({rank})" if rank else ""), ddp_strict, scale, birth, armed, hint, causes
    ) + "".join(f"\n- {f.kind} ({f.severity}): {f.message}" for f in late)
    return findings, message, quiet
