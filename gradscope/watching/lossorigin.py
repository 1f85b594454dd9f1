"""Which forward op made a loss that is already NaN/Inf (the armed backward's roots, NOTE [armed backward]).

NOTE [a non-finite loss]
When the loss itself is not finite, backward only carries that value down: the first backward op with a
non-finite gradient is the loss's own, and ``detect_anomaly()`` names the op whose backward turns the
``inf`` into NaN (``LogBackward0`` after ``log(softmax(x))`` underflowed to 0, or the ``SoftmaxBackward0``
below it), neither of which says why. The forward op that made the value is the earliest node (lowest
sequence number) of the loss's graph whose saved inputs are finite and singular for it: ``log`` of a 0
(``-inf``) or of a negative number (NaN), a division by 0, ``1/x`` or ``rsqrt`` at 0, ``sqrt`` of a
negative number; or whose saved result is not finite while its saved input is. The armed forward ran
under anomaly mode, so the node's traceback gives its line. Saved tensors are read, never kept.
Tested in tests/watch/test_watch_nan_loss.py.
"""

from __future__ import annotations

import re

import torch

from gradscope import _torch

__all__ = ["loss_origin", "MAX_NODES"]

MAX_NODES = 200_000
_OP = re.compile(r"Backward\d*$")

# op prefix -> (saved input, test on it, what it does there, the stable form)
_SINGULAR = {
    "Log": ("self", lambda t: t <= 0, "its input is 0 (or negative) there",
            "use torch.log_softmax (or F.cross_entropy on the logits) instead of log(softmax(x)), "
            "torch.logsumexp for log(sum(exp(x))), or clamp the input first (x.clamp_min(eps).log())"),
    "Div": ("other", lambda t: t == 0, "its denominator is 0 there", "add an eps to the denominator or clamp it"),
    "Reciprocal": ("self", lambda t: t == 0, "its input is 0 there", "add an eps or clamp the input"),
    "Rsqrt": ("self", lambda t: t == 0, "its input is 0 there", "add an eps inside the rsqrt"),
    "Sqrt": ("self", lambda t: t < 0, "its input is negative there", "clamp the input (x.clamp_min(0))"),
}  # fmt: skip


def _saved(node, name):
    try:
        v = getattr(node, _torch.SAVED_PREFIX + name)
    except (RuntimeError, AttributeError):
        return None
    return v if isinstance(v, torch.Tensor) and v.is_floating_point() else None


def _finite(t) -> bool:
    return bool(torch.isfinite(t).all())


def _why(node) -> tuple[str, str] | None:
    name = type(node).__name__
    for prefix, (slot, test, what, fix) in _SINGULAR.items():
        if name.startswith(prefix):
            t = _saved(node, slot)
            if t is not None and t.numel() and _finite(t) and bool(test(t).any()):
                return what, fix
            return None
    result, inp = _saved(node, "result"), _saved(node, "self")
    if result is not None and inp is not None and _finite(inp) and not _finite(result):
        return "its result overflows there", "compute it in a wider dtype or on smaller values"
    return None


def loss_origin(roots, locate, traverse) -> tuple[str, int, str, str | None] | None:
    """``(forward op, its node's sequence number, words, its line)`` of the earliest op that made the loss
    non-finite; ``locate(node)`` gives a node's forward line, ``traverse`` is the walk's bounded traversal
    (handed over by origin.py, which may import the walk)."""
    value = None
    stack = []
    for r in roots:
        if isinstance(r, torch.Tensor) and r.is_floating_point() and r.grad_fn is not None:
            d = r.detach()
            if not _finite(d):
                value = "NaN" if bool(torch.isnan(d).any()) else "-inf" if bool((d < 0).any()) else "inf"
                stack.append(r.grad_fn)
    if not stack:
        return None
    best: list = []

    def visit(node) -> bool:
        why = _why(node)
        if why is not None:
            seq = _torch.sequence_nr(node)
            if not best or seq < best[0]:
                best[:] = [seq, node, why]
        return True

    traverse(stack, visit, MAX_NODES)
    if not best:
        return None
    seq, node, (what, fix) = best
    op = _OP.sub("", type(node).__name__).lower() or type(node).__name__
    line = locate(node)
    del node
    at = f" at {line}" if line else ""
    return op, seq, f"The loss itself is {value}, made in the forward by {op}{at}: {what}. Fix: {fix}.", line
