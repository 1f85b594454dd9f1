"""The user's source line of every autograd node a traced forward creates (``report.graph`` ``location``).

NOTE [node lines]
The mode (:class:`gradscope.tracing.modes.CutMode`) peeks autograd's next sequence number before and
after each torch call it sees. When the two differ, the call made the nodes ``[before, after)`` and
:meth:`NodeLines.note` records the user's line of the call: the first frame outside torch and gradscope
(:func:`gradscope.tracing.probes.user_frame`, the rule of the events' ``location``). So an op inside a
module defined in the user's code gets the line in that module's ``forward``; an op inside one of torch's
own modules (``nn.Linear``, ``nn.MultiheadAttention``) gets the line that called the module; and a torch
function that runs many ops (``F.multi_head_attention_forward``) gives all their nodes its one line.

Lines are kept as segments, like the module attribution (NOTE [module attribution by sequence numbers]):
ascending start numbers and one line per segment, a new segment only when the line changes, so a
forward costs one entry per change of line, not per node. Lines are interned ``"file.py:LINE"`` strings
(cached per code object and instruction: ``_BY_CODE``); no frame or tensor is kept. Cost: about 0.5 µs
per torch call that makes nodes, plus 0.1-0.25 µs per torch frame between the user's line and the op
(each one the walk reads is materialised: 4 per ``nn.Module`` level).

Nodes made where the mode does not look show up as a gap: a call starts after the previous one ended. A
custom ``autograd.Function`` (reentrant ``checkpoint`` is one) numbers its node before its forward runs,
so its first op sees the gap with ``Function.apply`` on the stack: the gap gets the line that called
``apply`` (for ``checkpoint(...)``, the line that called ``checkpoint``). Any other gap, and every node
after the last call the mode saw, has no line (``None``: unknown, never a guess).
"""

from __future__ import annotations

import os
import sys
from array import array
from bisect import bisect_right
from types import CodeType, FrameType

from gradscope.tracing.probes import apply_caller, user_frame

__all__ = ["NodeLines", "ATTR"]

#: The node attribute written by :meth:`NodeLines.annotate` (``gradscope.graph.NodeAttrs.location``).
ATTR = "location"

# id(code) -> (the code object, f_lasti -> "file.py:LINE"). Frame.f_lineno scans the code's line table
# up to the current instruction (microseconds deep into a long forward); the instruction offset is free,
# so each (code, offset) pays it once. The entry keeps its code object, so that no other code can take
# its id while the entry exists; code holds no frame and no tensor. Bounded for generated code.
_BY_CODE: dict[int, tuple[CodeType, dict[int, str]]] = {}
_MAX_CODES = 8192


def _line(f: FrameType | None) -> str | None:
    """``"file.py:LINE"`` of frame ``f``, interned (None for None)."""
    if f is None:
        return None
    code = f.f_code
    entry = _BY_CODE.get(id(code))
    if entry is None or entry[0] is not code:
        if len(_BY_CODE) >= _MAX_CODES:
            _BY_CODE.clear()
        entry = _BY_CODE[id(code)] = (code, {})
    offset = f.f_lasti
    text = entry[1].get(offset)
    if text is None:
        text = entry[1][offset] = sys.intern(f"{os.path.basename(code.co_filename)}:{f.f_lineno}")
    return text


class NodeLines:
    """Sequence-number segments -> the user's line (see NOTE [node lines]). Plain data only."""

    __slots__ = ("starts", "lines", "end")

    def __init__(self, seq: int) -> None:
        self.starts = array("Q")  # segment starts, ascending
        self.lines: list[str | None] = []  # the line of each segment (None: unknown)
        self.end = seq  # the sequence number after the last call seen

    def note(self, start: int, end: int) -> None:
        """The torch call that just returned ran from sequence number ``start`` to ``end``.

        Called by the mode only when a call made nodes or a gap appeared (``start != end`` or ``start !=
        self.end``), directly from its ``__torch_function__``: the user's frame is above those two.
        """
        if start != self.end:  # nodes made where the mode did not look
            self._push(self.end, _line(apply_caller(sys._getframe(2))))
        if end != start:
            line = _line(user_frame(sys._getframe(2)))
            if line != self.lines[-1] if self.lines else True:  # else the same line goes on
                self._push(start, line)
        self.end = end

    def _push(self, seq: int, line: str | None) -> None:
        starts, lines = self.starts, self.lines
        if starts and seq <= starts[-1]:
            if seq == starts[-1]:  # the previous segment made no node: reuse it
                lines[-1] = line
            return  # numbers never go back on one thread; ignore rather than break the order
        if lines and lines[-1] == line:
            return  # the same line goes on
        starts.append(seq)
        lines.append(line)

    def at(self, seq: int | None) -> str | None:
        """The line that made node ``seq`` (None: unknown, or not made inside this recording)."""
        if seq is None or seq >= self.end:
            return None
        i = bisect_right(self.starts, seq) - 1
        return self.lines[i] if i >= 0 else None

    def annotate(self, ops) -> None:
        """Set :data:`ATTR` on each op node dict of ``ops`` whose line is known."""
        for data in ops:
            line = self.at(data.get("seq"))
            if line is not None:
                data[ATTR] = line
