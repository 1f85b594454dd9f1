"""The graph compiled for the backward replay, and the order autograd's engine runs its nodes.

NOTE [engine order] (docs/internals.md#engine-order)
``torch.autograd.backward`` counts dependencies by a walk from the roots (once per edge, duplicate edges
twice); then one ready queue on the calling thread (CPU and meta work) pops the ready node with the
highest ``_sequence_nr()`` first; AccumulateGrad nodes report UINT64_MAX. The queue is a
``std::priority_queue`` (libstdc++ binary heap), so nodes with equal sequence numbers (several ready
AccumulateGrads) come out in the heap's order: :func:`engine_steps` reproduces libstdc++'s ``push_heap`` /
``pop_heap`` step by step so that ties break exactly as in torch.

:func:`compile_graph` reads only ``report.graph`` (plain metadata), never a live tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "Program",
    "compile_graph",
    "engine_order",
    "engine_steps",
    "node_extras",
    "reentrant_nodes",
    "REENTRANT",
    "UINT64_MAX",
    "DTYPE_BYTES",
    "numel_bytes",
]

UINT64_MAX = (1 << 64) - 1

from gradscope.graph import HELD, PARAMS, ROOT_SHAPES, ROOTS  # noqa: E402
from gradscope.memory.replay.dtypes import DTYPE_BYTES, numel_bytes  # noqa: E402 - re-exported


@dataclass
class Program:
    """The graph as flat lists indexed by position (see :func:`compile_graph`).

    Attributes:
        ids: node ids of ``report.graph``; ``index`` maps them back.
        name: op name per node (``"AccumulateGrad"`` for leaves).
        seq: the engine's priority (``_sequence_nr()``; :data:`UINT64_MAX` for leaves).
        leaf: True for gradient accumulators (``kind`` param/input).
        edges: per node, ``(target index, target output)`` in ``next_functions`` order, duplicates kept.
        needs: per node, the input position of each edge (``next_functions`` index).
        grad_bytes: per node, the bytes of the gradient it receives for each of its forward outputs.
        grad_shapes: the same as shapes.
        saved: per node, the storage keys its saved slots hold (each once).
        storages: storage key -> bytes, for every held saved storage.
        shapes: storage key -> shape of the first slot that saved it (for size overrides).
        external: storage keys that backward cannot free (parameters, leaves, tensors the user holds).
        has_grad: per leaf index, whether ``.grad`` was already set when the graph was inspected.
        regions: non-reentrant checkpoint regions: region key -> node indices.
        recompute: per node, ``[(storage key, bytes)]`` its checkpointed slots re-create at first unpack.
        unheld: storage key -> bytes of a tensor no node saves any more after a dtype change (its readers
            save a float32 copy); a checkpoint frame that takes it as input still holds it.
        roots: root node indices; ``root_bytes`` the bytes of the seed gradient of each.
        module: per node, its module name (None when unknown).
        dtype_change: ``(orig, to, kept)``: ``orig`` tensors run in ``to`` but ``kept`` (NOTE [node facts]).
    """

    ids: list
    index: dict
    name: list
    seq: list
    leaf: list
    edges: list
    grad_bytes: list
    grad_shapes: list
    saved: list
    storages: dict
    shapes: dict
    external: set
    has_grad: dict
    roots: list
    root_bytes: list
    module: list
    attrs: list
    regions: dict = field(default_factory=dict)
    recompute: dict = field(default_factory=dict)
    opaque: list = field(default_factory=list)
    needs: list = field(default_factory=list)
    extra: dict | None = None  # node index -> its ``attrs`` the replay reads; None: read ``attrs[v]["attrs"]``
    leaf_info: dict | None = None  # leaf index -> (kind, name); None: read ``attrs``
    unheld: dict = field(default_factory=dict)
    dtype_change: tuple | None = None

    def leaves(self) -> dict:
        """Leaf index -> ``(kind, name)`` ("param"/"input", the parameter's name)."""
        if self.leaf_info is None:
            self.leaf_info = {
                i: (self.attrs[i].get("kind"), self.attrs[i].get("name")) for i, lf in enumerate(self.leaf) if lf
            }
        return self.leaf_info


def _edge_list(pred_v: dict, index: dict) -> tuple[list, list]:
    """``(edges, positions)``: ``(target, target output)`` per edge and its input position (duplicates of
    one target follow its first position)."""
    out, pos = [], []
    for u, e in sorted(pred_v.items(), key=lambda kv: kv[1].get("index", 0)):
        outs = e.get("outputs") or [e.get("output", 0)] * int(e.get("count", 1))
        for j, k in enumerate(outs):
            out.append((index[u], int(k)))
            pos.append(int(e.get("index", 0)) + j)
    return out, pos


def compile_graph(graph) -> Program:
    """Flatten ``report.graph`` for the replay (see :class:`Program`)."""
    from gradscope.graph.attribution import node_modules
    from gradscope.memory.replay.holders import external_storages
    from gradscope.memory.replay.regions import recorded_regions

    ids = list(graph.nodes)
    index = {n: i for i, n in enumerate(ids)}
    nodes = graph.nodes
    pred = getattr(graph, "_pred", None) or graph.pred
    mods = node_modules(graph)
    params = graph.graph.get(PARAMS, {})
    name, seq, leaf, edges, gbytes, gshapes, module, attrs, opaque = ([] for _ in range(9))
    saved: list[tuple] = []
    needs: list = []
    storages: dict = {}
    shapes: dict = {}
    has_grad: dict = {}
    external = external_storages(graph)
    for i, nid in enumerate(ids):
        d = nodes[nid]
        kind = d.get("kind")
        is_leaf = kind in ("param", "input")
        leaf.append(is_leaf)
        attrs.append(d)
        opaque.append(bool(d.get("opaque")))
        es, pos = _edge_list(pred[nid], index)
        edges.append(es)
        needs.append(pos)
        if is_leaf:
            name.append("AccumulateGrad")
            seq.append(UINT64_MAX)
            shape = d.get("shape") or []
            gshapes.append([shape])
            gbytes.append([numel_bytes(shape, d.get("dtype"))])
            grad = d.get("grad")
            if grad is None and kind == "param":
                grad = params.get(d["name"], {}).get("grad")
            has_grad[i] = bool(grad)
            saved.append(())
            module.append(d.get("module"))
            continue
        name.append(d.get("name", "?"))
        s = d.get("seq")
        seq.append(UINT64_MAX if s is None else int(s) % (1 << 64))
        outs = d.get("out_shapes") or []
        dts = d.get("out_dtypes") or []
        gshapes.append(outs)
        gbytes.append([numel_bytes(sh, dts[k] if k < len(dts) else node_dtype(d)) for k, sh in enumerate(outs)])
        module.append(mods.get(nid))
        saved.append(slot_keys(d.get("saved") or (), nid, storages, shapes))
    regions, recompute = recorded_regions(graph, index, saved, storages, shapes)
    roots = [index[r] for r in graph.graph.get(ROOTS, ()) if r in index]
    root_bytes = []
    for r, shape in zip(roots, graph.graph.get(ROOT_SHAPES, ())):
        d = nodes[ids[r]]
        dts = d.get("out_dtypes") or []
        root_bytes.append(numel_bytes(shape, dts[0] if dts else node_dtype(d)))
    return Program(
        ids,
        index,
        name,
        seq,
        leaf,
        edges,
        gbytes,
        gshapes,
        saved,
        storages,
        shapes,
        external,
        has_grad,
        roots,
        root_bytes,
        module,
        attrs,
        regions,
        recompute,
        opaque,
        needs,
    )


def slot_keys(slots, nid, storages: dict, shapes: dict) -> tuple:
    """The storage keys of a node's held saved slots (``slots``: the contract's slot dicts), each once; a
    storage met for the first time goes into ``storages`` (bytes) and ``shapes``."""
    keys: list = []
    for j, e in enumerate(slots):
        if e.get("status") not in HELD or e.get("scalar"):
            continue
        sid = e.get("storage")
        key = ("s", sid) if sid is not None else ("e", nid, j)
        if key not in storages:
            storages[key] = int(e.get("nbytes") or 0)
            shapes[key] = e.get("shape")
        if key not in keys:
            keys.append(key)
    return tuple(keys)


def node_dtype(d: dict) -> str:
    for e in d.get("saved") or ():
        if e.get("dtype") and not e.get("scalar") and str(e["dtype"]).startswith(("float", "bfloat", "complex")):
            return e["dtype"]
    return d.get("dtype") or "float32"


def dependencies(prog: Program) -> list[int]:
    """Incoming edge count per node, counted from the roots as the engine does (duplicates twice)."""
    n = len(prog.ids)
    deps = [0] * n
    seen = [False] * n
    edges = prog.edges
    stack = list(prog.roots)
    for r in stack:
        seen[r] = True
    push = stack.append
    while stack:
        for u, _ in edges[stack.pop()]:
            deps[u] += 1
            if not seen[u]:
                seen[u] = True
                push(u)
    return deps


def engine_order(prog: Program, run=None) -> list[int]:
    """Node indices in the order the engine runs them; ``run(v)`` is called per node when given.

    ``run`` receives the node index and must return nothing; readiness is tracked here.
    """
    order = _order(prog)
    if run is not None:
        for v in order:
            run(v)
    return order


def engine_steps(prog: Program):
    """Iterate the node indices in the engine's order (see :func:`engine_order`)."""
    return iter(_order(prog))


def _order(prog: Program) -> list[int]:
    """The engine's order as a list (nothing the replay does changes it: readiness depends on the graph
    alone, so it is computed before the replay in one loop instead of one generator step per node).

    The queue is ``std::priority_queue<NodeTask, vector, CompareNodeTaskTime>`` as libstdc++ implements it
    (``push_heap`` / ``pop_heap`` step by step, so that ties break exactly as in torch), inlined: the ready
    set is mostly one or two nodes, and a method call per push and pop cost more than the rest.
    """
    return _heap_order(prog, dependencies(prog))


def _heap_order(prog: Program, deps) -> list[int]:
    """The engine's order for the dependency counts ``deps`` (indexable by node; changed here)."""
    edges = prog.edges
    key = prog.seq  # one thread, no reentrant depth here: the sequence number alone orders the queue
    a: list = []  # the heap (libstdc++ layout)
    if len(prog.roots) == 1:
        a.append(prog.roots[0])
    else:  # a GraphRoot node sends each seed: roots become ready in root order, once each
        for r in dict.fromkeys(prog.roots):
            if not deps[r]:
                a.append(r)
                _sift_up(a, key, len(a) - 1, r)
    order: list[int] = []
    append = order.append
    pop = a.pop
    while a:
        top = a[0]  # pop_heap + pop_back: the hole goes down to a leaf, the last element goes up from it
        value = pop()
        if len(a) == 1:  # the last element takes the root
            a[0] = value
        elif a:
            n = len(a)
            hole = 0
            child = 2
            while child < n:
                if key[a[child]] < key[a[child - 1]]:
                    child -= 1
                a[hole] = a[child]
                hole = child
                child = 2 * (child + 1)
            if (n & 1) == 0 and child == n:
                a[hole] = a[child - 1]
                hole = child - 1
            _sift_up(a, key, hole, value)
        append(top)
        for u, _ in edges[top]:
            d = deps[u] - 1
            deps[u] = d
            if not d:  # push_heap (into an empty heap: nothing to sift, the common case)
                a.append(u)
                if len(a) == 2:  # one parent: the root
                    if key[a[0]] < key[u]:
                        a[0], a[1] = u, a[0]
                elif len(a) > 2:
                    _sift_up(a, key, len(a) - 1, u)
    return order


def _sift_up(a: list, key: list, hole: int, v: int) -> None:
    """libstdc++ ``__push_heap``: move ``v`` up from ``hole`` while its parent compares less."""
    kv = key[v]
    parent = (hole - 1) // 2
    while hole > 0 and key[a[parent]] < kv:
        a[hole] = a[parent]
        hole = parent
        parent = (hole - 1) // 2
    a[hole] = v


REENTRANT = "CheckpointFunctionBackward"


def node_extras(prog: Program) -> list:
    """Per node, the ``attrs`` the replay reads (alpha, a reentrant checkpoint's region) or None; cached on
    the program (``dataclasses.replace`` copies, as ``rewrite.py`` makes, start without it)."""
    got = prog.__dict__.get("_extras")
    if got is None:
        n = len(prog.name)
        if prog.extra is not None:
            got = [None] * n
            for v, d in prog.extra.items():
                if d and not prog.leaf[v]:
                    got[v] = d
        else:
            attrs = prog.attrs
            got = [None if lf else (attrs[v].get("attrs") or None) for v, lf in enumerate(prog.leaf)]
        prog.__dict__["_extras"] = got
    return got


def reentrant_nodes(prog: Program) -> list[tuple[int, dict]]:
    """``(node index, its attrs)`` of each reentrant checkpoint node (``{}`` when it has none)."""
    if REENTRANT not in prog.name:
        return []
    extras = node_extras(prog)
    return [(v, extras[v] or {}) for v, name in enumerate(prog.name) if name == REENTRANT]
