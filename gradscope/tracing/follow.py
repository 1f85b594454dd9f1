"""Where a cut's result went: the trace mode follows it to the first nodes made from it.

NOTE [where a cut joins]
A recorded cut explains a parameter's missing gradient only if its result went on into the graph
behind the loss: a .detach() kept for logging, or a no_grad merge of an adapter's weights into its base
layer, cuts nothing the loss uses. The mode follows each cut's tensor result (a weak reference by id),
and the results of ops that take it and still require no grad (detach().cpu(), a clone of an
inference_mode output); when an op that takes one of them makes autograd nodes, the event keeps that
op's range of sequence numbers (its ``joins``). checks/unused.py prefers a cut that joined a node of
the graph, and says "not used by this forward" for a module never called whose only cuts joined
nothing. Ops check their arguments against this table only while it holds something; it keeps weak
references only, and at most ``MAX_FOLLOWED`` of them (dead ones pruned first).
"""

from __future__ import annotations

import weakref

__all__ = ["CutFollower", "MAX_FOLLOWED"]

MAX_FOLLOWED = 4096  # cut results followed at once


class CutFollower:
    """``cut``: ``id(tensor) -> (weakref, event index)``; joins go to ``rec.join_event``."""

    __slots__ = ("cut", "rec", "on_pending")

    def __init__(self, rec):
        self.cut: dict = {}
        self.rec = rec
        # a followed result whose event is not recorded yet (NOTE [cuts that show after a Function returns]):
        # on_pending(pending, tensor) -> the event index, or None when the tensor turned out to have a graph
        self.on_pending = None

    def join(self, args, kwargs, seq: int, end: int) -> None:
        """An op that made the nodes ``[seq, end)`` took ``args``: note the followed results among them."""
        cut = self.cut
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, (tuple, list)):
                for t in a:
                    entry = cut.get(id(t))
                    if entry is not None and entry[0]() is t:
                        self._joined(entry[1], t, seq, end)
                continue
            entry = cut.get(id(a))
            if entry is not None and entry[0]() is a:
                self._joined(entry[1], a, seq, end)

    def _joined(self, index, t, seq: int, end: int) -> None:
        if type(index) is not int:  # pending
            index = self.on_pending(index, t) if self.on_pending is not None else None
            if index is None:
                self.cut.pop(id(t), None)
                return
            self.cut[id(t)] = (self.cut[id(t)][0], index)
        self.rec.join_event(index, seq, end)

    def carry(self, args, kwargs, out) -> None:
        """``out`` (no grad) was computed from a followed result: follow it for the same event."""
        cut = self.cut
        for a in (*args, *kwargs.values()) if kwargs else args:
            entry = cut.get(id(a))
            if entry is not None and entry[0]() is a:
                self.track(out, entry[1])
                return

    def track(self, out, index) -> None:
        """Follow ``out``, the result of the event at ``index``."""
        cut = self.cut
        if len(cut) >= MAX_FOLLOWED:
            for k in [k for k, (r, _) in cut.items() if r() is None]:
                del cut[k]
            if len(cut) >= MAX_FOLLOWED:
                return
        cut[id(out)] = (weakref.ref(out), index)
