"""Cheap probes of the running program for the trace mode: the user's line, which torch code is on the
stack (a custom Function, a reentrant checkpoint body, an optimizer), version counters of a call's
arguments. Plain functions over frames and tensors; nothing here keeps a tensor alive.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import torch

from gradscope._frames import frame_location, user_frame
from gradscope._torch import sequence_nr, version

__all__ = [
    "user_location",
    "is_function_forward",
    "user_frame",
    "apply_caller",
    "in_checkpoint",
    "checkpoint_region",
    "in_optimizer",
    "inside_function",
    "versions",
    "requires_grad",
    "grad_inputs",
    "SAVES_OUTPUT",
    "INPLACE_FLAG",
]

_Tensor = torch.Tensor


# NOTE [custom Function forwards on the stack]
# A frame running the ``forward`` of an ``autograd.Function`` subclass means we are inside a custom
# Function's forward (grad disabled by autograd, not by the user). Up to torch 2.14 ``Function.apply`` is
# a Python classmethod whose frame sits between the caller and ``forward``; from 2.15 it is a builtin with
# no frame, so the signal is the ``forward`` frame itself, on every release:
# docs/internals.md#custom-functions-on-the-stack.
_FORWARDS: dict[int, tuple[Any, bool]] = {}  # id(code) -> (code, is a Function forward); codes are few


def _function_forward_codes() -> set:
    """The code objects of ``forward`` of every ``autograd.Function`` subclass alive now (inherited ones
    included: a subclass without its own ``forward`` runs its base's)."""
    codes: set = set()
    seen: set = set()
    stack: list = [torch.autograd.Function]
    while stack:
        cls = stack.pop()
        for sub in type.__subclasses__(cls):
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
        fn = cls.__dict__.get("forward")
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is not None:
            codes.add(code)
    return codes


def is_function_forward(code: Any) -> bool:
    """Whether ``code`` (a frame's ``f_code``) is the ``forward`` of an ``autograd.Function`` subclass:
    a frame running it is inside ``Function.apply``. One lookup per code object after its first sight."""
    if code.co_name != "forward":
        return False
    known = _FORWARDS.get(id(code))
    if known is None or known[0] is not code:
        if len(_FORWARDS) > 4096:  # bounded: forward code objects are few in any real program
            _FORWARDS.clear()
        known = (code, code in _function_forward_codes())
        _FORWARDS[id(code)] = known
    return known[1]


def user_location(depth: int = 1) -> str | None:
    """``"file.py:LINE"`` (basename) of the first caller frame whose code is the user's (:mod:`gradscope._frames`),
    or None."""
    return frame_location(user_frame(sys._getframe(depth + 1)))


def apply_caller(f: FrameType | None) -> FrameType | None:
    """The user's frame that called the innermost ``autograd.Function.apply`` on the stack from ``f`` (the
    frame above the innermost Function ``forward``: ``apply`` itself is a builtin from torch 2.15)."""
    while f is not None:
        if is_function_forward(f.f_code):
            return user_frame(f.f_back)
        f = f.f_back
    return None


# NOTE [cuts inside autograd.Function]
# autograd runs every custom Function's forward with grad disabled, and reentrant checkpoint
# (CheckpointFunction) and compiled regions are such Functions. Ops there look like no_grad cuts, but the
# parameters get their gradients through the Function's own backward. We drop cut events while a
# Function.apply frame is on the stack; inspect reports those parameters as possibly hidden in an opaque
# node instead. In-place writes there are still recorded.
# NOTE [in-place on a slice]
# x[:, :2].sigmoid_() makes a CopySlices node that hides the SigmoidBackward inside it, with its saved
# result; a further in-place write to x (or any view of it) makes that result stale, and no walk can see
# it. In-place events through a view carry the storage they wrote (and later writes to any tensor do,
# once a view was written), so checks/inplace.py can pair the two writes.

# NOTE [in-place inside reentrant checkpoint]
# checkpoint(fn, use_reentrant=True) runs fn under no_grad in forward and again, with grad enabled, during
# backward; an in-place write there breaks only that second graph, which no walk can see. What the trace
# can see: inside a CheckpointFunction.forward frame, which op made each tensor. When the tensor written in
# place was made by an op whose backward needs its own output (sigmoid, tanh, exp, relu, softmax, ...),
# the recomputation saves that output and the write makes backward() raise: the in-place event carries
# that op as its ``producer`` and checks/inplace.py reports it. Tracking starts at the first checkpoint
# body seen (one stack walk per op there), so recordings without reentrant checkpoints pay nothing. A
# write to a tensor that a *later* op of the region saved as its input is not detected (documented).
SAVES_OUTPUT = frozenset(
    {
        "sigmoid",
        "tanh",
        "exp",
        "exp2",
        "relu",
        "softmax",
        "log_softmax",
        "sqrt",
        "rsqrt",
        "elu",
        "selu",
        "celu",
        "hardtanh",
        "relu6",
        "_softmax",
        "_log_softmax",
    }
)
_CKPT_FORWARD = None


# NOTE [parameters inside reentrant checkpoint]
# The walk cannot see the parameters a reentrant checkpoint body uses (they are not inputs of
# CheckpointFunctionBackward); the trace can: every op of the body runs under no_grad with the parameters
# as direct (leaf) inputs, which is a cut event we drop. We keep their ids instead, and inspect() treats
# them as reached through the region (they get gradients when backward() re-runs it).
def in_checkpoint() -> int | None:
    """The sequence number of the outermost reentrant checkpoint region on the stack, or None.

    The region is the ``ctx`` of its ``CheckpointFunction.forward`` frame, and a custom Function's ctx is
    its backward node: its ``_sequence_nr()`` names the node that ends up in the graph (or does not, when
    no input of the region requires grad).
    """
    global _CKPT_FORWARD
    if _CKPT_FORWARD is None:
        from torch.utils.checkpoint import CheckpointFunction

        _CKPT_FORWARD = CheckpointFunction.forward.__code__
    f: FrameType | None = sys._getframe(2)
    found = None
    while f is not None:
        if f.f_code is _CKPT_FORWARD:
            found = f
        f = f.f_back
    if found is None:
        return None
    try:
        return sequence_nr(found.f_locals["ctx"])
    except (KeyError, AttributeError, RuntimeError):
        return -1


def checkpoint_region(f: FrameType | None) -> tuple[FrameType | None, bool]:
    """``(frame, nested)``: the outermost ``CheckpointFunction.forward`` frame above ``f`` (None: none), and
    whether the call at ``f`` runs below another autograd Function inside it (a custom Function, a nested
    reentrant checkpoint): not one of the region's own top-level calls. The caller must not keep the frame.
    """
    global _CKPT_FORWARD
    if _CKPT_FORWARD is None:
        from torch.utils.checkpoint import CheckpointFunction

        _CKPT_FORWARD = CheckpointFunction.forward.__code__
    found = None
    applies = below = ckpts = 0
    while f is not None:
        code = f.f_code
        if code is _CKPT_FORWARD:
            found, below, ckpts = f, applies, ckpts + 1
        elif is_function_forward(code):
            applies += 1
        f = f.f_back
    return found, found is not None and (ckpts > 1 or below > 0)


# NOTE [in-place writes inside torch functions]
# F.dropout(x, inplace=True), F.relu(x, inplace=True) or F.embedding(..., max_norm=...) write a tensor
# inside the Python function, where the mode is not active, so the write itself is never seen. For the
# functions of torch.nn.functional we read the version counters of the tensor arguments that require grad
# before and after the call: a counter that moved is an in-place write at the user's line of that call.
INPLACE_FLAG = frozenset(
    {
        "dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "alpha_dropout",
        "feature_alpha_dropout",
        "relu",
        "relu6",
        "leaky_relu",
        "elu",
        "selu",
        "celu",
        "hardtanh",
        "threshold",
        "rrelu",
        "hardswish",
        "silu",
        "mish",
        "hardsigmoid",
    }
)


def versions(args, kwargs) -> list:
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, _Tensor) and a.requires_grad:
            try:
                out.append((a, version(a)))
            except RuntimeError:  # inference tensors have no version counter
                pass
    return out


_OPTIM_DIR = os.path.join(os.path.dirname(torch.__file__), "optim") + os.sep


def in_optimizer() -> bool:
    """Whether torch.optim code is on the stack (an optimizer's step() writing the parameters)."""
    f: FrameType | None = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.startswith(_OPTIM_DIR):
            return True
        f = f.f_back
    return False


def inside_function() -> bool:
    f: FrameType | None = sys._getframe(2)
    while f is not None:
        if is_function_forward(f.f_code):
            return True
        f = f.f_back
    return False


def requires_grad(out) -> bool | None:
    """True/False for a tensor result (or a tuple/list holding tensors); None when no tensor came back."""
    if isinstance(out, _Tensor):
        return out.requires_grad
    if isinstance(out, (tuple, list)):
        found = None
        for o in out:
            if isinstance(o, _Tensor):
                if o.requires_grad:
                    return True
                found = False
        return found
    return None


def grad_inputs(args, kwargs) -> list:
    """The tensors among ``args``/``kwargs`` (one list level deep) that require grad."""
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, _Tensor):
            if a.requires_grad:
                out.append(a)
        elif isinstance(a, (tuple, list)):
            out.extend(t for t in a if isinstance(t, _Tensor) and t.requires_grad)
    return out
