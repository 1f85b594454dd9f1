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
``signature.py`` (None where the dict is read).
"""

from __future__ import annotations

__all__ = ["DictFacts", "facts", "slots_of"]


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


def facts(prog):
    """The node facts of ``prog`` (its ``attrs`` when they answer them, else :class:`DictFacts`), kept on it."""
    got = prog.__dict__.get("_facts")
    if got is None:
        attrs = prog.attrs
        got = prog.__dict__["_facts"] = attrs if hasattr(attrs, "slots") else DictFacts(attrs)
    return got
