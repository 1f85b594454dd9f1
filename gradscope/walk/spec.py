"""What the walk knows about a node class, computed once per class: :class:`ClassSpec`.

The loop (``loop.py``) looks a node's class up in :data:`SPECS` once per node; everything it needs to read
the node without asking the class again is a named field here (NOTE [walk fast path]).
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any, NamedTuple

from gradscope.walk.copyslices import NAME as COPY_SLICES
from gradscope.walk.outputs import OUT_SLOT
from gradscope.walk.saved import NodeType, node_type, plain_value

__all__ = ["OP", "LEAF", "OTHER", "ClassSpec", "SPECS", "class_spec", "read_values"]

#: What kind of node a class makes: a built-in op (the fast path may read it), an AccumulateGrad leaf,
#: or another node (a custom Function, CopySlices: the general reader).
OP, LEAF, OTHER = 0, 1, 2


class ClassSpec(NamedTuple):
    """The per-class facts of one node class."""

    code: int  # OP, LEAF or OTHER
    name: str  # "AddmmBackward0", "MyFnBackward" for a custom Function
    tensor_slots: tuple[tuple[str, str, str], ...]  # (slot, "_raw_saved_<slot>", "_saved_<slot>")
    value_slots: tuple[tuple[str, str], ...]  # (slot, "_saved_<slot>")
    info: NodeType  # the general reader's view of the class (saved.py)
    vget: Callable[[Any], Any] | None  # every value slot in one C call (attrgetter), None when there is none
    one_value: bool  # vget gives the value itself (one value slot), not a tuple
    out_slot: str | None  # the saved slot whose tensor is the node's output (NOTE [outputs from a saved slot])


#: node class -> its :class:`ClassSpec` (classes are few: a model has tens of them)
SPECS: dict[type, ClassSpec] = {}


def class_spec(node) -> ClassSpec:
    """The :class:`ClassSpec` of ``node``'s class, made and cached on first sight."""
    info = node_type(node)
    code = LEAF if info.leaf else (OTHER if info.custom or info.name == COPY_SLICES else OP)
    attrs = [attr for _, attr in info.value_slots]
    out_slot = OUT_SLOT.get(info.name) if code == OP else None
    if out_slot is not None and out_slot not in {s for s, _, _ in info.tensor_slots}:
        out_slot = None
    spec = SPECS[type(node)] = ClassSpec(
        code,
        info.name,
        info.tensor_slots,
        info.value_slots,
        info,
        attrgetter(*attrs) if attrs else None,
        len(attrs) == 1,
        out_slot,
    )
    return spec


#: Types of saved values kept as read (NOTE [compact records]): they hold no tensor; the records turn
#: them into the contract's plain values (negative ints, lists) when a node's dict is built.
_RAW_OK = frozenset((int, tuple, float, bool, type(None), str))


def _value(node, attr):
    try:
        return getattr(node, attr)
    except RuntimeError:
        return None


def read_values(node, spec: ClassSpec) -> Any:
    """The non-tensor saved values of a fast-path op: ``()``, the value itself (one slot) or a tuple aligned
    with ``spec.value_slots``; plain Python data (``values.plain_value`` for anything else)."""
    vget = spec.vget
    values: Any
    if vget is None:
        return ()
    if spec.one_value:
        try:
            values = vget(node)
        except RuntimeError:
            values = None
        return values if type(values) in _RAW_OK else plain_value(values)
    try:  # raw values: plain Python data (ints, int tuples, floats, bools, None, str)
        values = vget(node)
    except RuntimeError:
        values = tuple(_value(node, attr) for _, attr in spec.value_slots)
    if not _RAW_OK.issuperset(map(type, values)):
        values = tuple(map(plain_value, values))
    return values
