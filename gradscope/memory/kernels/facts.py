"""What the in-node signatures and the gradient layouts read of one node of a compiled program.

NOTE [node facts]
A node's signature (``signature.py``) and the layout of the gradient it receives (``layout.py``) read a
few things of each node: its saved slots (slot, shape, strides, dtype, wrapped scalar, status), its saved
values, its output shapes and dtypes, its custom Function, and the dtype of output ``k`` (a leaf's own;
float32 when not recorded). A program compiled
from the walk's compact records answers them from the columns (``memory/replay/columns.py``,
``NodeAttrs``), without building the node's contract dict; a program compiled from a DiGraph from its
dicts (:class:`DictFacts`). Both give the same values: a node whose dict was already built (a trace
annotates every op) or that the general reader read is answered from its dict in both.
``NodeAttrs.raw_key`` adds a hashable digest of the node's own part of its signature, the memo key of
``signature.py`` (None where the dict is read). A program whose dtypes were changed (FSDP2's
``param_dtype``: ``Program.dtype_change``) answers through :class:`CastFacts`, so its nodes are measured
in the dtype they run in (a bfloat16 matmul's backward allocates what a float32 one does not).
"""

from __future__ import annotations

__all__ = ["CastFacts", "DictFacts", "facts", "slots_of"]


def slots_of(entries) -> list:
    """Saved-slot dicts as ``(slot, shape, stride, dtype, scalar, status)`` tuples (shape and stride as
    recorded: None when unknown)."""
    return [
        (e.get("slot"), e.get("shape"), e.get("stride"), e.get("dtype"), bool(e.get("scalar")), e.get("status"))
        for e in entries
    ]


class DictFacts:
    """The facts of a program whose ``attrs`` are node dicts (compiled from a DiGraph)."""

    __slots__ = ("_attrs", "_slots")

    def __init__(self, attrs) -> None:
        self._attrs = attrs
        self._slots: dict = {}

    def raw_key(self, i: int) -> None:
        return None

    def slots(self, i: int) -> list:
        got = self._slots.get(i)
        if got is None:
            got = self._slots[i] = slots_of(self._attrs[i].get("saved") or ())
        return got

    def values(self, i: int) -> dict:
        return self._attrs[i].get("attrs") or {}

    def outputs(self, i: int) -> tuple:
        d = self._attrs[i]
        return d.get("out_shapes") or (), d.get("out_dtypes") or ()

    def function(self, i: int):
        return self._attrs[i].get("function")

    def dtype(self, i: int, k: int) -> str:
        d = self._attrs[i]
        if d.get("kind") in ("param", "input"):
            return d.get("dtype") or "float32"
        dts = d.get("out_dtypes") or ()
        return dts[k] if k < len(dts) and dts[k] else "float32"


class CastFacts:
    """The facts of a program whose tensors of dtype ``orig`` run in ``to`` (``Program.dtype_change``):
    every saved slot, output and leaf of dtype ``orig`` is in ``to`` but those ``kept`` names (node index ->
    (saved slot positions, output indices)). No raw key: its signatures are built from these values."""

    __slots__ = ("_base", "_orig", "_to", "_kept", "_leaf")

    def __init__(self, base, change: tuple, leaf) -> None:
        self._base = base
        self._orig, self._to, self._kept = change
        self._leaf = leaf

    def _cast(self, dtype):
        return self._to if (dtype or "float32") == self._orig else dtype

    def raw_key(self, i: int) -> None:
        return None

    def slots(self, i: int) -> list:
        kept = self._kept.get(i, ((), ()))[0]
        return [
            (slot, shape, stride, dtype if j in kept or scalar else self._cast(dtype), scalar, status)
            for j, (slot, shape, stride, dtype, scalar, status) in enumerate(self._base.slots(i))
        ]

    def values(self, i: int) -> dict:
        return self._base.values(i)

    def outputs(self, i: int) -> tuple:
        shapes, dts = self._base.outputs(i)
        kept = self._kept.get(i, ((), ()))[1]
        return shapes, [dt if k in kept else self._cast(dt) for k, dt in enumerate(dts)]

    def function(self, i: int):
        return self._base.function(i)

    def dtype(self, i: int, k: int) -> str:
        dt = self._base.dtype(i, k)
        return dt if not self._leaf[i] and k in self._kept.get(i, ((), ()))[1] else self._cast(dt)


def facts(prog):
    """The node facts of ``prog`` (its ``attrs`` when they answer them, else :class:`DictFacts`; through
    :class:`CastFacts` after a dtype change), kept on it."""
    got = prog.__dict__.get("_facts")
    if got is None:
        attrs = prog.attrs
        got = attrs if hasattr(attrs, "slots") else DictFacts(attrs)
        change = getattr(prog, "dtype_change", None)
        if change is not None:
            got = CastFacts(got, change, prog.leaf)
        prog.__dict__["_facts"] = got
    return got
