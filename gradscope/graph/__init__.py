"""The schema of ``report.graph`` and the questions every reader asks of it, answered once.

``report.graph`` is a ``networkx.DiGraph`` of plain metadata built by the walk (:mod:`gradscope.walk`):
an edge ``u -> v`` means ``v`` consumed ``u``'s output. This module is the one place that says what its
attributes are (:class:`NodeAttrs`, :class:`SavedEntry`, :class:`EdgeAttrs`, :class:`GraphAttrs`, the
key constants) and the one implementation of the shared queries:

- :func:`held_bytes`: saved bytes, each storage counted once;
- :func:`forward_order`: op nodes in forward creation order;
- :func:`node_modules`: which module owns each node (NOTE [inferring modules]);
- :func:`storage_uses`: every saved storage once, with its owner (NOTE [one storage, one owner]).

Everything here reads only the metadata graph, so it works the same on a report loaded back from JSON.
It imports nothing from gradscope but :mod:`gradscope._format`: the walk, the checks, memory and the
views all depend on it, never the other way round.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict

import networkx as nx

from gradscope._format import lcp

__all__ = [
    "NodeAttrs",
    "SavedEntry",
    "EdgeAttrs",
    "ParamInfo",
    "TraceEvent",
    "GraphAttrs",
    "OP",
    "PARAM",
    "INPUT",
    "HELD",
    "LIVE",
    "STALE",
    "HOOKED",
    "OFFLOADED",
    "RECOMPUTED",
    "OPAQUE",
    "FREED",
    "ROOTS",
    "ROOT_SHAPES",
    "NO_GRAD_ROOTS",
    "STORAGE_BYTES",
    "PARAMS",
    "EVENTS",
    "CALLED_MODULES",
    "EVENTS_DROPPED",
    "ROOT_STORAGE_BYTES",
    "EXTERNAL",
    "BUFFERS",
    "StorageUse",
    "held_bytes",
    "forward_order",
    "node_modules",
    "storage_uses",
    "param_storages",
    "is_traced",
]

# -- node kinds ------------------------------------------------------------------------------------
OP = "op"  #: a backward node (``grad_fn``)
PARAM = "param"  #: an ``AccumulateGrad`` of a named parameter
INPUT = "input"  #: an ``AccumulateGrad`` of a leaf that is not a named parameter

# -- saved-slot states (NOTE [saved slot states] in gradscope/walk/saved.py) -----------------------
LIVE, STALE, HOOKED = "live", "stale", "hooked"
OFFLOADED, RECOMPUTED, OPAQUE, FREED = "offloaded", "recomputed", "opaque", "freed"
#: Slot states whose bytes the graph holds on the tensor's device.
HELD = (LIVE, STALE, HOOKED)

# -- graph.graph keys ------------------------------------------------------------------------------
ROOTS = "roots"  #: list of root node ids, in the order the roots were given
ROOT_SHAPES = "root_shapes"  #: list of root shapes (lists of ints), parallel to ROOTS
NO_GRAD_ROOTS = "no_grad_roots"  #: indices of given roots that have no grad_fn (several roots only)
STORAGE_BYTES = "storage_bytes"  #: storage id -> whole-storage size in bytes (a list)
PARAMS = "params"  #: qualified name -> ParamInfo, every named parameter
EVENTS = "events"  #: list of TraceEvent (only with trace=)
CALLED_MODULES = "called_modules"  #: sorted names of the modules the traced forward called (trace=)
EVENTS_DROPPED = "events_dropped"  #: how many events the trace did not keep (only when > 0)
ROOT_STORAGE_BYTES = "root_storage_bytes"  #: whole-storage bytes of each root (None: unknown), parallel to ROOTS
EXTERNAL = "external"  #: storage ids a holder outside the graph keeps alive (NOTE [holder counts])
BUFFERS = "buffers"  #: ``[storage id or None, bytes]`` per distinct buffer storage of model=


class SavedEntry(TypedDict, total=False):
    """One saved slot of a node (``node["saved"][i]``)."""

    slot: str  # the slot name, e.g. "self", "mat2", "result"
    shape: list[int] | None
    dtype: str | None  # "float32"
    device: str | None  # "cpu", "meta", ...; for offloaded: the device the tensor left
    nbytes: int  # the whole storage's size (untyped_storage().nbytes()), not the view's
    status: str  # one of the saved-slot states above
    storage: int | None  # storage id (an index into graph.graph["storage_bytes"]); None: unknown
    scalar: bool  # present (True) on a wrapped Python number (``x * 2``): not an activation
    version: int  # stale only: the tensor's version now (it was modified in place)
    saved_version: int | None  # stale only: the version backward expects (from torch's error text); None: unknown
    recompute: dict[str, Any]  # recomputed (checkpoint) only, when the frame tells: {"region", "index", "shape",
    # "dtype", "nbytes", "frame_bytes"} of what backward's recompute re-creates


class NodeAttrs(TypedDict, total=False):
    """Attributes of every node (``report.graph.nodes[nid]``); leaves also carry shape/dtype/requires_grad."""

    kind: Literal["op", "param", "input"]
    name: str  # "AddmmBackward0", or the parameter's qualified name, or "input"
    saved: list[SavedEntry]
    saved_bytes: int  # bytes this node's held slots keep alive (its storages counted once)
    device: str | None
    module: str | None  # the owning module: from trace() on ops, from the qualified name on params
    location: str  # traced ops only, when known: the user's "file.py:LINE" that created the node
    root: bool
    opaque: bool  # a node whose saved values cannot be read (checkpoint, compiled)
    seq: int | None  # autograd sequence number (forward creation order); None on leaves
    attrs: dict[str, Any]  # non-tensor saved values (dims, sizes, flags) as plain data
    out_shapes: list[list[int]]
    out_dtypes: list[str]  # ops: the dtype of each output, parallel to out_shapes
    function: str  # custom autograd.Function: "module.QualName"
    shape: list[int]  # leaves only
    dtype: str  # leaves only
    requires_grad: bool  # leaves only
    grad: bool  # leaves only: .grad was already set when inspected (backward adds into it)
    planned: str  # only while Plan.render() draws: "checkpoint" / "offload"
    memory_peak: str  # only while BackwardMemory.render() draws: the peak's label line


class EdgeAttrs(TypedDict):
    """Attributes of an edge ``u -> v``: ``v`` consumed output ``output`` of ``u`` as its input ``index``."""

    index: int  # position in v's next_functions
    output: int  # output number of u (a multi-output op such as split)
    count: int  # how many of v's inputs are this output
    outputs: NotRequired[list[int]]  # only when v consumes several outputs of u: each input's output number


class ParamInfo(TypedDict):
    """``graph.graph["params"][name]``."""

    requires_grad: bool
    shape: list[int]
    dtype: str
    node: str | None  # the param node, None when the root does not reach it
    storage: int | None
    grad: bool  # .grad was already set when inspected
    pid: int  # id() of the parameter tensor (matches checkpoint regions' parameters)


class TraceEvent(TypedDict, total=False):
    """``graph.graph["events"][i]``: a cut or an in-place op recorded by ``trace()``."""

    kind: str  # "detach", ".data", "no_grad-region", "to-python", "non-differentiable-op", "inplace"
    op: str
    location: str | None  # "file.py:12 in forward"
    params: list[str]  # parameters that fed the cut input
    module: str | None
    seq: int  # the sequence number current when the event was recorded
    shape: list[int] | None
    version: int  # in-place: the tensor's version after the write


class GraphAttrs(TypedDict, total=False):
    """``report.graph.graph``."""

    roots: list[str]
    root_shapes: list[list[int]]
    no_grad_roots: list[int]
    storage_bytes: list[int]
    params: dict[str, ParamInfo]
    events: list[TraceEvent]
    called_modules: list[str]
    events_dropped: int
    checkpoint_params: dict[
        str, list[int]
    ]  # traced: parameter -> sequence numbers of the reentrant checkpoint regions that used it
    root_storage_bytes: list[int | None]
    external: list[int]
    buffers: list[list]
    input_storages: dict[str, int]  # input leaf node id -> the storage id an op saved it under


# -- held bytes ------------------------------------------------------------------------------------
def held_bytes(graph: nx.DiGraph, nodes: Iterable[str] | None = None) -> int:
    """Bytes held by saved tensors in ``graph`` (or only in ``nodes``), each storage counted once.

    Wrapped Python scalars are left out, as are slots that hold nothing on the device (recomputed,
    offloaded, freed). Entries without a storage id (sparse tensors) are counted one by one.

    Example:
        >>> import torch, gradscope
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> report = gradscope.inspect((x * x).sum())        # mul saves x twice: one storage
        >>> held_bytes(report.graph) == report.saved_bytes == 64
        True
    """
    seen: set = set()
    total = 0
    attrs = graph.nodes
    for data in attrs.values() if nodes is None else (attrs[n] for n in nodes):
        for e in data["saved"]:
            if e["status"] not in HELD or e.get("scalar"):
                continue
            sid = e["storage"]
            if sid is not None:
                if sid in seen:
                    continue
                seen.add(sid)
            total += e["nbytes"]
    return total


# -- forward order ---------------------------------------------------------------------------------
def forward_order(graph: nx.DiGraph) -> list[str]:
    """Op node ids in forward creation order (``seq``).

    Ties keep node order; ops without a sequence number (a hand-built or old graph) come last, after
    every op whose creation time is known, so they never take a storage's ownership or split a
    contiguous ``seq`` interval.
    """
    big = float("inf")
    ops = [(n, d.get("seq")) for n, d in graph.nodes(data=True) if d.get("kind") == OP]
    ops.sort(key=lambda ns: big if ns[1] is None else ns[1])  # stable: ties stay in node order
    return [n for n, _ in ops]


# -- module ownership ------------------------------------------------------------------------------
# NOTE [inferring modules]
# A traced graph (trace=) carries `module` on op nodes; we use it as is, None included (an op outside every
# module, such as the loss). A parameter node's module comes from its qualified name. Without a trace an
# op is *anchored* to the longest common dotted prefix of the modules of the parameters it uses: consumed
# directly (AccumulateGrad -> AddmmBackward0), through a parameter-only view (TBackward0 of `a.weight`),
# or saved by storage (LayerNorm's weight, mm's weight.t()). Every other op takes the common prefix of the
# nearest anchored ops before and after it in forward order: the attention matmuls between
# `blocks.0.attn.qkv` and `blocks.0.attn.proj` land in `blocks.0.attn`, a residual add between
# `layers.0.attn.proj` and `layers.0.norm` in `layers.0`, the loss after the last module in no module.
# One exception: a view (ViewBackward0, UnsafeViewBackward0) next to an anchored mm/addmm in forward order
# (at most 2 apart) and linked to it by an edge takes the mm's module: F.linear on a 3-d input reshapes
# before and after its addmm, inside the Linear.
# This mimics the trace's sequence-range attribution (TORCH-FACTS section 5) without hooks;
# tests/walk/test_graph.py checks it against trace() on real models.


def is_traced(graph: nx.DiGraph) -> bool:
    """True when module names on op nodes come from ``trace()``."""
    return CALLED_MODULES in graph.graph or any(
        d.get("module") for _, d in graph.nodes(data=True) if d.get("kind") == OP
    )


def param_storages(graph: nx.DiGraph) -> dict[int, set[str]]:
    """Storage id -> modules of the named parameters living in it."""
    out: dict[int, set[str]] = {}
    for name, p in graph.graph.get(PARAMS, {}).items():
        if p.get("storage") is not None:
            mods = out.setdefault(p["storage"], set())
            head = name.rpartition(".")[0]
            if head:
                mods.add(head)
    return out


#: How far (in forward order) a reshaping op may sit from the anchor it is glued to, and which ops glue:
#: the views that F.linear / matmul put around their mm on inputs of more than two dimensions.
_GLUE = 2
_VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
_MATMULS = frozenset({"AddmmBackward0", "MmBackward0"})


def _common(mods: Iterable[str]) -> str | None:
    out = None
    for i, m in enumerate(sorted(mods)):
        out = m if i == 0 else lcp(out, m)
    return out


def _anchors(graph: nx.DiGraph, order: list[str]) -> dict[str, str]:
    """Op node -> module, for the ops that use parameters (see NOTE [inferring modules])."""
    nodes = graph.nodes
    pred = graph.pred
    by_storage = param_storages(graph)
    via: dict[str, set] = {}  # leaf or parameter-only view (weight.t()) -> its modules
    for nid, d in nodes(data=True):
        if d["kind"] == PARAM:
            via[nid] = {d["module"]} if d.get("module") else set()
    for nid in order:
        d = nodes[nid]
        if not d["saved"] and pred[nid] and all(nodes[w]["kind"] == PARAM for w in pred[nid]):
            via[nid] = {nodes[w]["module"] for w in pred[nid] if nodes[w].get("module")}
    out = {}
    for nid in order:
        mods: set = set()
        for u in pred[nid]:
            mods.update(via.get(u, ()))
        if by_storage:
            for e in nodes[nid]["saved"]:
                mods.update(by_storage.get(e.get("storage"), ()))
        m = _common(mods)
        if m:
            out[nid] = m
    rank = {n: i for i, n in enumerate(order)}
    succ = graph.succ
    glued = {}
    for nid in order:  # the views F.linear makes around its mm belong to the Linear
        if nid in out or nodes[nid]["name"] not in _VIEWS:
            continue
        near = [
            m
            for m in (*pred[nid], *succ[nid])
            if m in out and nodes[m]["name"] in _MATMULS and abs(rank[m] - rank[nid]) <= _GLUE
        ]
        if near:
            glued[nid] = out[min(near, key=lambda m: (abs(rank[m] - rank[nid]), -rank[m]))]
    out.update(glued)
    return out


def node_modules(graph: nx.DiGraph, order: list[str] | None = None) -> dict[str, str | None]:
    """The module owning every node (``None``: no module); see NOTE [inferring modules].

    Args:
        graph: ``report.graph``.
        order: :func:`forward_order` of the graph, when the caller already has it.

    Returns:
        ``{node id: module name or None}`` for every node, ops and leaves.

    Example:
        >>> import torch, gradscope
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        >>> report = gradscope.inspect(net(torch.randn(2, 3)).sum(), model=net)
        >>> sorted({(d["name"], m) for n, m in node_modules(report.graph).items()
        ...         for d in [report.graph.nodes[n]] if d["kind"] == "op"}, key=str)   # doctest: +NORMALIZE_WHITESPACE
        [('AddmmBackward0', '0'), ('AddmmBackward0', '2'), ('ReluBackward0', None), ('SumBackward0', None),
         ('TBackward0', '0'), ('TBackward0', '2')]
    """
    nodes = graph.nodes
    out = {n: d.get("module") for n, d in nodes(data=True)}
    if is_traced(graph):
        return out
    order = forward_order(graph) if order is None else order
    tagged = _anchors(graph, order)
    before: dict = {}
    last: str | None = None
    seen_tag = False
    for n in order:
        if n in tagged:
            last, seen_tag = tagged[n], True
        else:
            before[n] = last if seen_tag else None
    nxt: str | None = None
    for n in reversed(order):
        if n in tagged:
            nxt = out[n] = tagged[n]
        else:
            out[n] = lcp(before[n], nxt)
    return out


# -- storages --------------------------------------------------------------------------------------
@dataclass(slots=True)
class StorageUse:
    """One saved storage, counted once (see NOTE [one storage, one owner] in gradscope/graph/attribution.py)."""

    key: tuple
    nbytes: int
    category: str  # "held" | "params" | "offloaded"
    owner: str  # node id of the first node that saved it
    device: str | None  # the device it was saved from (for offloaded: the device it left)
    users: list[str] = field(default_factory=list)  # node ids that saved it, forward order


def storage_uses(graph: nx.DiGraph, order: list[str] | None = None) -> list[StorageUse]:
    """Every saved storage once, in the order its owner was created.

    Args:
        graph: ``report.graph``.
        order: :func:`forward_order` of the graph, when the caller already has it.
    """
    params = param_storages(graph)
    uses: dict[tuple, StorageUse] = {}
    nodes = graph.nodes
    for nid in forward_order(graph) if order is None else order:
        for i, e in enumerate(nodes[nid]["saved"]):
            status = e["status"]
            if e.get("scalar") or (status not in HELD and status != OFFLOADED):
                continue
            sid = e["storage"]
            if status == OFFLOADED:
                cat = "offloaded"
            else:
                cat = "params" if sid is not None and sid in params else "held"
            key = ("s", sid) if sid is not None else ("e", nid, i)
            use = uses.get(key)
            if use is None:
                uses[key] = StorageUse(key, int(e["nbytes"]), cat, nid, e.get("device"), [nid])
                continue
            if nid not in use.users:
                use.users.append(nid)
            if use.category == "offloaded" and cat != "offloaded":
                use.category, use.owner, use.device = cat, nid, e.get("device")
    return list(uses.values())
