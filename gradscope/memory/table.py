"""``report.memory()``: where the saved-tensor memory goes, per module, per op kind or per node.

Each saved storage is counted once and attributed to the first node that saved it in forward creation
order (see NOTE [one storage, one owner] in :mod:`gradscope.graph.attribution`), so the table's activations plus
parameters equal ``report.saved_bytes`` exactly.
"""

from __future__ import annotations

import html
from collections import Counter, defaultdict
from dataclasses import dataclass

from gradscope._format import human_bytes, one_line
from gradscope.errors import InputValueError
from gradscope.graph.attribution import NO_MODULE, module_bytes, node_bytes, node_modules, seq_order, storage_uses

__all__ = [
    "memory",
    "MemoryRow",
    "MemoryTable",
    "DeviceTotal",
    "CopyNode",
    "Shared",
    "module_bytes",
    "node_bytes",
    "node_modules",
    "NO_MODULE",
]

BY = ("module", "op", "node")


@dataclass(frozen=True, slots=True)
class _Counts:
    """The counts a :class:`MemoryRow` and a :class:`DeviceTotal` share, after the name of the group."""

    name: str
    nodes: int = 0
    held: int = 0
    params: int = 0
    offloaded: int = 0


@dataclass(frozen=True, slots=True)
class MemoryRow(_Counts):
    """Saved-tensor memory of one group (a module, an op kind, or a node).

    Attributes:
        name: the module's qualified name (or ``"(no module)"``), the op name, or ``"n12 AddmmBackward0"``.
        nodes: op nodes in the group.
        held: activation bytes held until backward (storages this group saved first).
        params: bytes of parameters saved by reference: no memory beyond the parameter itself.
        offloaded: bytes moved to the CPU by ``torch.autograd.graph.save_on_cpu`` (the CPU copies).
        recomputed: saved tensors that ``checkpoint(use_reentrant=False)`` recomputes in backward (0 bytes held).
        shared: storages of this group that another group saved too (counted once, at the first saver).
        tensors: saved tensor slots in the group.
    """

    recomputed: int = 0
    shared: int = 0
    tensors: int = 0


@dataclass(frozen=True, slots=True)
class DeviceTotal(_Counts):
    """Saved bytes on the device ``name``: ``nodes`` op and leaf nodes there, ``offloaded`` bytes sent to the CPU."""

    @property
    def device(self) -> str:  # the name: "cpu", "cuda:0", "meta"
        return self.name


@dataclass(frozen=True, slots=True)
class CopyNode:
    """An op node whose input lives on another device (``ToCopyBackward0`` after ``x.to('cuda')``...)."""

    node: str
    name: str
    source: str
    target: str


@dataclass(frozen=True, slots=True)
class Shared:
    """A storage saved by several groups: counted once, in ``owner``."""

    nbytes: int
    category: str
    owner: str
    others: tuple[str, ...]


class MemoryTable(list):
    """The rows of :func:`memory` (a ``list`` of :class:`MemoryRow`, largest first), printable.

    Attributes:
        by: ``"module"``, ``"op"`` or ``"node"``.
        total: a :class:`MemoryRow` named ``"total"`` over the whole graph (all rows, even when ``top``
            cut the list).
        devices: ``{device: DeviceTotal}``.
        copies: the :class:`CopyNode` list; non-empty when the graph spans devices.
        sharing: the :class:`Shared` storages, largest first.
        freed, opaque: saved slots already freed by a backward, or packed by hooks we cannot read.
    """

    def __init__(self, rows, *, by, total, devices, copies, sharing, freed=0, opaque=0):
        super().__init__(rows)
        self.by = by
        self.total = total
        self.devices = devices
        self.copies = copies
        self.sharing = sharing
        self.freed = freed
        self.opaque = opaque

    @property
    def saved_bytes(self) -> int:
        """Held activations plus parameters saved by reference: equals ``report.saved_bytes``."""
        return self.total.held + self.total.params

    @property
    def spans_devices(self) -> bool:
        """True when the graph's nodes live on more than one device."""
        return len(self.devices) > 1

    def row(self, name: str) -> MemoryRow:
        """The row called ``name``, or a row of zeros when no node belongs to it."""
        for r in self:
            if r.name == name:
                return r
        return MemoryRow(name)

    # -- views -----------------------------------------------------------------------------------
    def _columns(self):
        cols = [("nodes", "nodes", False), ("activations", "held", True), ("params (by ref)", "params", True)]
        if self.total.offloaded:
            cols.append(("to CPU", "offloaded", True))
        if self.total.recomputed:
            cols.append(("recomputed", "recomputed", False))
        if self.total.shared:
            cols.append(("shared", "shared", False))
        return cols

    def _notes(self) -> list[str]:
        t = self.total
        notes = [
            f"{human_bytes(self.saved_bytes)} held by saved tensors = {human_bytes(t.held)} activations"
            f" + {human_bytes(t.params)} parameters saved by reference (no extra memory)"
        ]
        if t.offloaded:
            notes.append(f"{human_bytes(t.offloaded)} moved to the CPU by save_on_cpu (not held on the device)")
        if t.recomputed:
            notes.append(f"{t.recomputed} saved tensors are recomputed by checkpoint during backward (held: 0 B)")
        if self.freed:
            notes.append(f"{self.freed} saved tensors were already freed by a backward (held: 0 B)")
        if self.opaque:
            notes.append(
                f"{self.opaque} saved tensors are packed by saved_tensors_hooks gradscope cannot read (not counted)"
            )
        devs = []
        for d in self.devices.values():
            text = f"{d.device} {human_bytes(d.held + d.params)}"
            if d.offloaded:
                text += f" (+{human_bytes(d.offloaded)} moved to CPU)"
            if d.device == "meta":
                text += " (shapes only: no real memory)"
            devs.append(text)
        if devs:
            notes.append("per device: " + ", ".join(devs))
        if self.spans_devices:
            moves = ", ".join(f"{c.node} {c.name} ({c.source} -> {c.target})" for c in self.copies[:6])
            more = f" and {len(self.copies) - 6} more" if len(self.copies) > 6 else ""
            notes.append(f"the graph spans {len(self.devices)} devices; copies: {moves or 'none found'}{more}")
        for s in self.sharing[:3]:
            notes.append(
                f"shared: {human_bytes(s.nbytes)} counted in {s.owner}, also saved by "
                + ", ".join(s.others[:3])
                + (" ..." if len(s.others) > 3 else "")
            )
        return notes

    def _cells(self, r: MemoryRow, cols) -> list[str]:
        return [human_bytes(getattr(r, a)) if is_bytes else str(getattr(r, a)) for _, a, is_bytes in cols]

    def __str__(self) -> str:
        cols = self._columns()
        head = [self.by] + [c for c, _, _ in cols]
        body = [[r.name] + self._cells(r, cols) for r in self] + [["total"] + self._cells(self.total, cols)]
        widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]

        def line(cells):
            return "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(cells))

        out = [f"Saved-tensor memory by {self.by}:"] + ["  " + n for n in self._notes()] + [""]
        out.append(line(head))
        out.append("  ".join("-" * w for w in widths))
        out.extend(line(b) for b in body[:-1])
        out.append(line(body[-1]))
        return "\n".join(out)

    def __repr__(self) -> str:
        return self.__str__()

    def _repr_html_(self) -> str:
        cols = self._columns()
        e = html.escape
        rows = "".join(
            "<tr><td style='text-align:left'>"
            + e(r.name)
            + "</td>"
            + "".join(f"<td>{e(c)}</td>" for c in self._cells(r, cols))
            + "</tr>"
            for r in self
        )
        total = (
            "<tr style='font-weight:bold'><td style='text-align:left'>total</td>"
            + "".join(f"<td>{e(c)}</td>" for c in self._cells(self.total, cols))
            + "</tr>"
        )
        head = "".join(f"<th>{e(h)}</th>" for h in [self.by] + [c for c, _, _ in cols])
        notes = "".join(f"<li>{e(n)}</li>" for n in self._notes())
        return (
            f"<div class='gradscope-memory'><ul>{notes}</ul><table style='text-align:right'>"
            f"<thead><tr>{head}</tr></thead><tbody>{rows}{total}</tbody></table></div>"
        )

    def to_svg(self, top: int = 12, width: int = 640) -> str:
        """A horizontal bar chart of the ``top`` rows (activations, parameters, CPU copies) as an SVG string.

        Example:
            >>> from IPython.display import SVG                 # doctest: +SKIP
            >>> SVG(report.memory().to_svg())                   # doctest: +SKIP
        """
        from gradscope.svgchart import bar_chart

        return bar_chart(self[:top], title=f"saved-tensor memory by {self.by}", width=width)


def _group_of(by: str, graph, depth: int | None = None):
    if by == "module":
        mods = node_modules(graph)
        if depth is not None:
            mods = {n: m if m == NO_MODULE else ".".join(m.split(".")[:depth]) for n, m in mods.items()}
        return mods.__getitem__
    if by == "op":
        return lambda nid: graph.nodes[nid]["name"]
    return lambda nid: f"{nid} {graph.nodes[nid]['name']}"


def memory(report, *, by: str = "module", depth: int | None = None, top: int | None = None) -> MemoryTable:
    """Saved-tensor memory per module, op kind or node, each storage counted once.

    Args:
        report: a :class:`~gradscope.Report` (from ``inspect`` or ``gradscope.load``).
        by: ``"module"`` (the traced module, else the module whose parameters the node uses, else
            ``"(no module)"``), ``"op"`` (``AddmmBackward0``...) or ``"node"``.
        depth: with ``by="module"``, merge submodules into their first ``depth`` name components
            (``depth=2``: ``blocks.3.attn.q`` counts as ``blocks.3``).
        top: keep only the ``top`` largest rows (``total`` still covers the whole graph).

    Returns:
        A :class:`MemoryTable`: rows sorted by bytes held (activations plus CPU copies, then parameters),
        with ``total``, ``devices``, ``copies`` and ``sharing``; ``print()`` it for an aligned table.

    Raises:
        InputValueError: ``by`` is not one of ``"module"``, ``"op"``, ``"node"``, or ``depth``/``top`` is
            not a positive integer.

    Example:
        >>> table = report.memory()                  # doctest: +SKIP
        >>> table.saved_bytes == report.saved_bytes  # doctest: +SKIP
        True
    """
    if by not in BY:
        raise InputValueError(f"memory(by={by!r}) is not supported; use one of {', '.join(map(repr, BY))}.")
    for name, value in (("depth", depth), ("top", top)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputValueError(f"memory({name}={one_line(value)}) must be a positive integer or None.")
    graph = report.graph
    group = _group_of(by, graph, depth)
    acc: dict[str, dict] = {}
    freed = opaque = 0
    order = seq_order(graph)
    nodes = graph.nodes
    fields = ("nodes", "held", "params", "offloaded", "recomputed", "shared", "tensors")
    for nid in order:
        saved = nodes[nid]["saved"]
        if by == "node" and not saved:
            continue
        name = group(nid)
        a = acc.get(name)
        if a is None:
            a = acc[name] = dict.fromkeys(fields, 0)
        a["nodes"] += 1
        if saved:
            a["tensors"] += len(saved)
            for e in saved:
                status = e["status"]
                if status == "recomputed":
                    a["recomputed"] += 1
                elif status == "freed":
                    freed += 1
                elif status == "opaque":
                    opaque += 1
    sharing = []
    devices: defaultdict[str, Counter] = defaultdict(Counter)
    for use in storage_uses(graph, order):
        owner = group(use.owner)
        acc[owner][use.category] += use.nbytes
        devices[use.device or "?"][use.category] += use.nbytes
        groups = list(dict.fromkeys(group(u) for u in use.users)) if len(use.users) > 1 else ()
        if len(groups) > 1:
            for g in groups:
                acc[g]["shared"] += 1
            sharing.append(Shared(use.nbytes, use.category, owner, tuple(groups[1:])))
    for _, d in graph.nodes(data=True):  # op nodes and leaves (a CPU input copied to the GPU)
        dev = d.get("device")
        if dev is not None:
            devices[dev]["nodes"] += 1
    rows = [MemoryRow(name, **a) for name, a in acc.items()]
    rows.sort(key=lambda r: (-(r.held + r.offloaded), -r.params, -r.recomputed, -r.nodes, r.name))
    sums = {f: sum(getattr(r, f) for r in rows) for f in ("held", "params", "offloaded", "recomputed")}
    total = MemoryRow("total", len(order), **sums, shared=len(sharing), tensors=sum(r.tensors for r in rows))
    sharing.sort(key=lambda s: (-s.nbytes, s.owner))
    return MemoryTable(
        rows[:top] if top is not None else rows,
        by=by,
        total=total,
        devices={k: DeviceTotal(k, **v) for k, v in sorted(devices.items())},
        copies=_copies(graph, order),
        sharing=sharing,
        freed=freed,
        opaque=opaque,
    )


def _copies(graph, order) -> list[CopyNode]:
    devices = {n: d.get("device") for n, d in graph.nodes(data=True)}
    if len(set(devices.values()) - {None}) < 2:
        return []
    out: list[CopyNode] = []
    pred = graph.pred
    for nid in order:
        dst = devices[nid]
        if dst is None:
            continue
        srcs = sorted({devices[u] for u in pred[nid]} - {None, dst})
        out.extend(CopyNode(nid, graph.nodes[nid]["name"], s, dst) for s in srcs)
    return out
