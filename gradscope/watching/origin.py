"""Where a NaN/Inf gradient was born: per-node checks, armed only after a non-finite step.

NOTE [armed backward]
Healthy steps pay nothing here. When a check finds a non-finite gradient, the guard *arms*: at the next
forward of the watched model, anomaly mode is switched on with ``check_nan=False`` (it records each new
node's forward traceback in ``node.metadata['traceback_']``, and raises nothing), and module entries and
exits are noted by sequence number; ``torch.autograd._engine_run_backward`` is wrapped for one call so the
next backward hands over its roots. There, anomaly mode is restored and one post hook goes on every node
of that graph: the first node (in execution order) whose outputs are not finite is where the non-finite
value was born, and the first whose outputs hold NaN is the one ``torch.autograd.detect_anomaly()`` would
name ("Function 'X' returned nan values"). The hooks are removed at the end of that backward. If that
backward is healthy the guard disarms; if not, the finding names the op, its module, the forward line and
the likely cause read from the node's saved inputs.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from typing import NamedTuple

import torch

from gradscope import _torch
from gradscope._frames import is_user_file
from gradscope.walk.traverse import traverse
from gradscope.watching.lossorigin import loss_origin

__all__ = ["Origin", "Birth"]

_NODES_AT_MOST = 200_000
_TB_RE = re.compile(r'File "([^"]+)", line (\d+)')
_HALF_MAX = {torch.float16: 65504.0, torch.bfloat16: 3.39e38}


class Birth(NamedTuple):
    op: str  # SqrtBackward0
    nan_op: str | None  # first op whose output held NaN (what anomaly mode names)
    module: str | None  # qualified module name of the forward op, when known
    location: str | None  # forward file:line, when traced
    cause: str  # likely cause, in words


def _saved(node, name):
    try:
        v = getattr(node, _torch.SAVED_PREFIX + name)
    except (RuntimeError, AttributeError):
        return None
    return v if isinstance(v, torch.Tensor) else None


def _zero(t) -> bool:
    return t is not None and t.numel() > 0 and bool((t == 0).any())


def _cause(node, grad_inputs, grad_outputs) -> str:
    name = type(node).__name__
    incoming_zero = any(g is not None and bool((g == 0).any()) for g in grad_outputs)
    nan = any(g is not None and g.is_floating_point() and bool(torch.isnan(g).any()) for g in grad_inputs)
    saved_nan = any(
        t is not None and t.is_floating_point() and bool(torch.isnan(t).any())
        for t in (_saved(node, "self"), _saved(node, "result"))
    )
    trap = (
        " This op's incoming gradient is 0 where its result is NaN (0 x inf = NaN): a torch.where, clamp "
        "or mask downstream sent a zero gradient to positions where its derivative is infinite or "
        "undefined (the torch.where trap)"
        + (
            "; its forward value there is already NaN (sqrt or log of a negative number), hidden by the "
            "branch that was not selected"
            if saved_nan
            else ""
        )
        + ". Make those inputs safe before the op, e.g. op(torch.where(mask, x, 1.0))."
        if nan and incoming_zero
        else ""
    )
    singular = {
        "Sqrt": (
            "result",
            "sqrt at 0: its derivative 1/(2*sqrt(x)) is infinite there (so is a "
            "hand-written norm sqrt(sum(x**2)) of a zero vector); use "
            "x.clamp_min(eps).sqrt() or torch.linalg.vector_norm",
        ),
        "Rsqrt": ("self", "rsqrt at 0; add an eps"),
        "Log": (
            "self",
            "log at 0: its derivative 1/x is infinite there; use torch.log(x + eps) or "
            "log_softmax instead of log(softmax)",
        ),
        "Reciprocal": ("self", "1/x at 0; add an eps"),
        "Div": ("other", "division by zero (the denominator is 0); add an eps to it"),
        "LinalgVectorNorm": (
            "result",
            "the norm of a zero vector (x / ||x|| is 0/0); use F.normalize(x, eps=...) or clamp the norm",
        ),
        "Norm": ("result", "the norm of a zero vector; clamp the norm"),
    }
    for prefix, (slot, text) in singular.items():
        if name.startswith(prefix) and _zero(_saved(node, slot)):
            return f"Likely cause: {text}.{trap}"
    if name.startswith("Pow"):
        base, exponent = _saved(node, "self"), getattr(node, _torch.SAVED_PREFIX + "exponent", None)
        if _zero(base):
            return (
                f"Likely cause: pow(x, {exponent}) at x = 0, whose derivative is infinite for exponents "
                f"below 1 (a hand-written norm sqrt(sum(x**2)) does this too); add an eps.{trap}"
            )
    for g in grad_inputs:
        if g is not None and g.dtype in _HALF_MAX and bool(torch.isinf(g).any()):
            return (
                f"Likely cause: overflow in {str(g.dtype).replace('torch.', '')} (largest finite value "
                f"{_HALF_MAX[g.dtype]:g}): scale the loss with torch.amp.GradScaler, compute this op in "
                f"float32, or clip the gradients."
            )
    if trap:
        return "Likely cause: the torch.where trap." + trap
    return (
        "Likely cause: this op's derivative is infinite or undefined at the values it saw, or an "
        "overflow of large gradients; look at its inputs at the line above."
    )


def _traceback_location(node) -> str | None:
    frames = (getattr(node, "metadata", None) or {}).get("traceback_")
    for line in reversed(frames or []):
        m = _TB_RE.search(line)
        if m and is_user_file(m.group(1)):
            return f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}"
    return None


class Origin:
    """The armed per-node search of one guard (NOTE [armed backward])."""

    def __init__(self, root, safety):
        self._root = root
        # NOTE [never break training]: every hook goes through the guard's Safety
        self._roots_hook = lambda roots: safety.run("NaN origin", self._on_roots, roots)
        self._node_hook = lambda gi, go: safety.run("NaN origin", self._post, gi, go)
        self.armed = False
        self._tracing = None  # anomaly state to restore while the armed forward records
        self._segments: list[tuple[int, str | None]] = []
        self._stack: list[str | None] = []
        self._module_hooks: list = []
        self._node_hooks: list = []
        self._birth = None  # (node, name, seq, cause)
        self._nan_op = None

    def arm(self) -> None:
        if not self.armed:
            self.armed = True
            _torch.on_next_backward(self._roots_hook)

    def disarm(self) -> None:
        self.armed = False
        _torch.cancel_next_backward(self._roots_hook)
        self._stop_tracing()
        self._drop_node_hooks()

    # -- the armed forward ---------------------------------------------------------------------
    def before_forward(self) -> None:
        if not self.armed or self._tracing is not None:
            return
        self._tracing = _torch.anomaly_state()
        _torch.set_anomaly((True, False))
        names = {id(m): n for n, m in self._root.named_modules()}
        self._segments = [(_torch.peek_sequence_nr(), "")]  # inside the root module's own forward
        self._stack = [""]

        def pre(module, _args):
            name = names.get(id(module))
            if name is not None:
                self._stack.append(name)
                self._segments.append((_torch.peek_sequence_nr(), name))

        def post(module, _args, _out):
            if names.get(id(module)) is not None and self._stack:
                self._stack.pop()
                self._segments.append((_torch.peek_sequence_nr(), self._stack[-1] if self._stack else None))

        self._module_hooks = [
            _torch.register_module_forward_pre_hook(pre),
            _torch.register_module_forward_hook(post, always_call=True),
        ]

    def _stop_tracing(self) -> None:
        if self._tracing is not None:
            _torch.set_anomaly(self._tracing)
            self._tracing = None
        for h in self._module_hooks:
            h.remove()
        self._module_hooks, self._stack = [], []

    # -- the armed backward --------------------------------------------------------------------
    def _on_roots(self, roots) -> None:
        self._stop_tracing()
        self._birth, self._nan_op = None, None
        stack: list[torch.autograd.graph.Node] = []
        for r in roots:
            fn = r.grad_fn if isinstance(r, torch.Tensor) else getattr(r, "node", None)
            if fn is not None:
                stack.append(fn)
            if (
                self._birth is None
                and isinstance(r, torch.Tensor)
                and r.is_floating_point()
                and not bool(torch.isfinite(r.detach()).all())
            ):
                made = loss_origin(roots, _traceback_location, traverse)  # NOTE [a non-finite loss]
                self._birth = (
                    ("the forward", made[1], made[2], made[3])
                    if made is not None
                    else (
                        "the forward",
                        -1,
                        "Likely cause: the loss itself is already NaN/Inf, so the "
                        "forward produced it (bad input data, an overflow, a log or division in the "
                        "loss); check the inputs and the loss with torch.isfinite before backward.",
                        None,
                    )
                )
        hook = self._node_hook

        def hook_node(n) -> bool:
            self._node_hooks.append(n.register_hook(hook))
            return True

        traverse(stack, hook_node, _NODES_AT_MOST)

    def _post(self, grad_inputs, grad_outputs):
        if self._nan_op is not None:
            return
        bad = nan = False
        for g in grad_inputs:
            if g is not None and g.is_floating_point() and not bool(torch.isfinite(g).all()):
                bad = True
                nan = nan or bool(torch.isnan(g).any())
        if not bad:
            return
        node = _torch.current_autograd_node()
        if node is None:
            return
        if self._birth is None:
            self._birth = (
                type(node).__name__,
                _torch.sequence_nr(node),
                _cause(node, grad_inputs, grad_outputs),
                _traceback_location(node),
            )
        if nan:
            self._nan_op = type(node).__name__

    def _drop_node_hooks(self) -> None:
        for h in self._node_hooks:
            h.remove()
        self._node_hooks = []

    def result(self) -> Birth | None:
        """At the end of a backward: what the armed search found (None if it was not armed)."""
        self._drop_node_hooks()
        if self._birth is None:
            return None
        name, seq, cause, location = self._birth
        self._birth = None
        module = None
        if self._segments:
            i = bisect_right([s for s, _ in self._segments], seq) - 1
            module = self._segments[i][1] if i >= 0 else None
        return Birth(name, self._nan_op, module, location, cause)
