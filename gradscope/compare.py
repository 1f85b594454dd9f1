"""``gradscope.diff(a, b)``: what changed between two reports (two models, two steps, before/after a fix).

Node ids are positions in one walk, so nothing is matched by id: op nodes are compared as counts per op
name, parameters by qualified name, saved bytes per module (see :func:`gradscope.memory.table.memory`), and
findings by ``(kind, parameters, name of the node)``.
"""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gradscope._format import human_bytes
from gradscope.errors import InputTypeError
from gradscope.memory.table import MemoryRow, memory

if TYPE_CHECKING:
    from gradscope.report import Report

__all__ = ["diff", "Diff"]

_BYTES = ("held", "params", "offloaded")
_SHOW = 15  # modules listed in the text; Diff.modules has them all


def _signed(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "±") + human_bytes(abs(n))


@dataclass(frozen=True)
class Diff:
    """The differences between report ``a`` (before) and report ``b`` (after); falsy when there are none.

    Attributes:
        totals: ``{name: (a, b)}`` for ``nodes``, ``saved_bytes``, ``activations``, ``params``,
            ``offloaded``, ``recomputed`` and ``findings`` (every total, changed or not).
        ops: ``{op name: (count in a, count in b)}`` for the op kinds whose count changed.
        params_added, params_removed: parameters reached in only one of the two graphs.
        modules: ``{module: (row in a, row in b)}`` (:class:`~gradscope.memory.table.MemoryRow`, zeros when
            absent) for the modules whose saved bytes or recomputed tensors changed (op counts are in ``ops``).
        appeared, disappeared: findings present only in ``b`` / only in ``a``.
    """

    totals: dict
    ops: dict = field(default_factory=dict)
    params_added: tuple = ()
    params_removed: tuple = ()
    modules: dict = field(default_factory=dict)
    appeared: tuple = ()
    disappeared: tuple = ()

    def __bool__(self) -> bool:
        return bool(
            self.ops
            or self.params_added
            or self.params_removed
            or self.modules
            or self.appeared
            or self.disappeared
            or any(a != b for a, b in self.totals.values())
        )

    @property
    def added(self) -> dict:
        """``{op name: how many more}`` in ``b``."""
        return {k: b - a for k, (a, b) in self.ops.items() if b > a}

    @property
    def removed(self) -> dict:
        """``{op name: how many fewer}`` in ``b``."""
        return {k: a - b for k, (a, b) in self.ops.items() if a > b}

    def _lines(self) -> list[str]:
        t = self.totals
        na, nb = t["nodes"]
        sa, sb = t["saved_bytes"]
        out = [
            f"gradscope diff: {na} -> {nb} nodes ({nb - na:+d}), saved {human_bytes(sa)} -> "
            f"{human_bytes(sb)} ({_signed(sb - sa)})"
        ]
        if not self:
            out.append("no differences: same op kinds, parameters, saved bytes per module and findings.")
            return out
        for key, label in (
            ("activations", "activations held"),
            ("params", "parameters saved by reference"),
            ("offloaded", "moved to CPU by save_on_cpu"),
        ):
            a, b = t[key]
            if a != b:
                out.append(f"  {label}: {human_bytes(a)} -> {human_bytes(b)} ({_signed(b - a)})")
        a, b = t["recomputed"]
        if a != b:
            out.append(f"  saved tensors recomputed by checkpoint (held 0 B): {a} -> {b}")
        if self.ops:
            out.append("op kinds (before -> after):")
            for name, (a, b) in self.ops.items():
                out.append(f"  {'+' if b > a else '-'}{abs(b - a):<4} {name} ({a} -> {b})")
        for label, names in (
            ("parameters reached only after", self.params_added),
            ("parameters reached only before", self.params_removed),
        ):
            if names:
                out.append(f"{label}: " + ", ".join(names))
        if self.modules:
            width = max(len(m) for m in self.modules)
            out.append("saved bytes by module (activations + parameters + CPU copies, before -> after):")
            for name, (a, b) in list(self.modules.items())[:_SHOW]:
                ta, tb = (sum(getattr(r, f) for f in _BYTES) for r in (a, b))
                extra = f", recomputed {a.recomputed} -> {b.recomputed}" if a.recomputed != b.recomputed else ""
                out.append(
                    f"  {name:<{width}}  {human_bytes(ta):>10} -> {human_bytes(tb):>10}  "
                    f"({_signed(tb - ta)}; activations {human_bytes(a.held)} -> {human_bytes(b.held)}"
                    f"{extra})"
                )
            if len(self.modules) > _SHOW:
                out.append(f"  ... and {len(self.modules) - _SHOW} more modules (see Diff.modules)")
        for label, fs in (("findings that appeared", self.appeared), ("findings that disappeared", self.disappeared)):
            if fs:
                out.append(f"{label}:")
                out.extend(
                    f"  {f.severity} {f.kind}" + (f" ({', '.join(f.params)})" if f.params else "") + f": {f.message}"
                    for f in fs
                )
        return out

    def __str__(self) -> str:
        return "\n".join(self._lines())

    def __repr__(self) -> str:
        t = self.totals
        return (
            f"<gradscope.Diff: {'no differences' if not self else 'differences'}, nodes "
            f"{t['nodes'][0]} -> {t['nodes'][1]}, saved {human_bytes(t['saved_bytes'][0])} -> "
            f"{human_bytes(t['saved_bytes'][1])}>"
        )

    def to_svg(self, top: int = 8, width: int = 640) -> str:
        """Before/after bars for the ``top`` modules that changed most, as an SVG string.

        Example:
            >>> from IPython.display import SVG                 # doctest: +SKIP
            >>> SVG(gradscope.diff(plain, checkpointed).to_svg())  # doctest: +SKIP
        """
        from dataclasses import replace

        from gradscope.svgchart import bar_chart

        rows = []
        for name, (a, b) in list(self.modules.items())[:top]:
            rows += [replace(a, name=f"{name} before"), replace(b, name=f"{name} after")]
        sa, sb = self.totals["saved_bytes"]
        title = f"saved tensors by module: {human_bytes(sa)} before, {human_bytes(sb)} after"
        return bar_chart(rows, title=title, width=width)

    def _repr_html_(self) -> str:
        return f"<pre class='gradscope-diff'>{html.escape(str(self))}</pre>"


def _finding_key(report, f) -> tuple:
    g = report.graph
    name = g.nodes[f.node]["name"] if f.node is not None and f.node in g else None
    return (f.kind, tuple(f.params), name)


def _check(report, which: str) -> None:
    if not hasattr(report, "graph") or not hasattr(report, "findings"):
        raise InputTypeError(
            f"diff() needs two gradscope reports; report_{which} is "
            f"{type(report).__name__}. Pass gradscope.inspect(...) results or "
            "gradscope.load('x.json')."
        )


def diff(report_a: Report, report_b: Report, *, depth: int | None = None) -> Diff:
    """Compare two reports: op kinds, parameters, saved bytes per module, findings, totals.

    Args:
        report_a: the "before" report (plain model, step 1...).
        report_b: the "after" report (checkpointed model, step N...).
        depth: compare saved bytes per module merged to their first ``depth`` name components (see
            :func:`gradscope.memory.table.memory`); None compares every module.

    Returns:
        A :class:`Diff`; ``bool(d)`` is False when nothing changed, ``print(d)`` shows the changes.

    Raises:
        InputTypeError: an argument is not a report.
        InputValueError: ``depth`` is not a positive integer.

    Example:
        >>> d = gradscope.diff(plain_report, checkpointed_report)     # doctest: +SKIP
        >>> d.totals["activations"]                                   # doctest: +SKIP
        (26880, 4096)
    """
    _check(report_a, "a")
    _check(report_b, "b")
    ga, gb = report_a.graph, report_b.graph
    ca = Counter(d["name"] for _, d in ga.nodes(data=True) if d.get("kind") == "op")
    cb = Counter(d["name"] for _, d in gb.nodes(data=True) if d.get("kind") == "op")
    ops = {k: (ca[k], cb[k]) for k in sorted(ca.keys() | cb.keys()) if ca[k] != cb[k]}
    pa = {d["name"] for _, d in ga.nodes(data=True) if d.get("kind") == "param"}
    pb = {d["name"] for _, d in gb.nodes(data=True) if d.get("kind") == "param"}
    ma, mb = memory(report_a, depth=depth), memory(report_b, depth=depth)
    modules = {}
    for name in sorted({r.name for r in ma} | {r.name for r in mb}):
        a, b = ma.row(name), mb.row(name)
        if _changed(a, b):
            modules[name] = (a, b)
    modules = dict(sorted(modules.items(), key=lambda kv: (-abs(_size(kv[1][1]) - _size(kv[1][0])), kv[0])))
    fa = Counter(_finding_key(report_a, f) for f in report_a.findings)
    fb = Counter(_finding_key(report_b, f) for f in report_b.findings)
    appeared = tuple(f for f in report_b.findings if _take(fb, fa, _finding_key(report_b, f)))
    fa = Counter(_finding_key(report_a, f) for f in report_a.findings)
    fb = Counter(_finding_key(report_b, f) for f in report_b.findings)
    disappeared = tuple(f for f in report_a.findings if _take(fa, fb, _finding_key(report_a, f)))
    totals = {
        "nodes": (ga.number_of_nodes(), gb.number_of_nodes()),
        "saved_bytes": (report_a.saved_bytes, report_b.saved_bytes),
        "activations": (ma.total.held, mb.total.held),
        "params": (ma.total.params, mb.total.params),
        "offloaded": (ma.total.offloaded, mb.total.offloaded),
        "recomputed": (ma.total.recomputed, mb.total.recomputed),
        "findings": (len(report_a.findings), len(report_b.findings)),
    }
    return Diff(totals, ops, tuple(sorted(pb - pa)), tuple(sorted(pa - pb)), modules, appeared, disappeared)


def _size(r: MemoryRow) -> int:
    return r.held + r.params + r.offloaded


def _changed(a: MemoryRow, b: MemoryRow) -> bool:
    """Saved bytes or recomputed tensors changed (a module whose node count alone changed, ``0 B -> 0 B``,
    is not listed: its ops are in ``Diff.ops``)."""
    return any(getattr(a, f) != getattr(b, f) for f in _BYTES + ("recomputed",))


def _take(mine: Counter, other: Counter, key) -> bool:
    """True for the occurrences of ``key`` in ``mine`` beyond those in ``other`` (consumes one)."""
    if mine[key] > other[key]:
        mine[key] -= 1
        return True
    return False
