"""The pieces of :func:`~gradscope.memory.replay.simulate.simulate` that one node's step calls: what one run
reads at every node (:class:`Run`), the saved storages and seed gradients alive when backward starts, a
checkpoint region's tensors re-created when its first node runs (NOTE [recompute step by step] in
:mod:`gradscope.memory.replay.recompute`), an AccumulateGrad's step, the bytes a formula makes after it
returns, the workspace per node, and the parameters a traced reentrant region shares with the graph.

The pieces that run at every node take the current ``level`` and ``high`` and return them (the replay keeps
both in locals); a piece that calls :class:`~gradscope.memory.replay.gradients.Memory` writes them to ``mem``
first and reads them back after.

NOTE [node sub-programs] (docs/memory.md#compiled-regions)
Most nodes run one formula: outputs, then workspace freed before they return (simulate.py NOTE [what one
node does to memory]). A node that runs a whole graph of ops, a ``torch.compile`` region
(``CompiledFunctionBackward``, whose steps the walk reads from its backward graph: walk/regionmem.py NOTE
[compiled region memory]) or a custom ``autograd.Function`` traced on fake tensors, instead gives the
replay a list of :class:`Step` (defined in memory/kernels/regions.py, where the steps of a compiled region
are built; re-exported here), one per op in the order its code runs them: the bytes the op allocates,
the bytes of the node's own temporaries that die after it, and the saved storages whose last use inside
the node it was (one reference each, freed when nothing else holds them: shared storages and
``retain_graph=True`` are the replay's business, as for any node). At the node the replay runs the steps
on its level (the node's highest point is the highest step), takes off what the steps left (the output
gradients, which the engine's usual step then makes per edge, so views, stealing and InputBuffer sums
stay as for any node) and releases the saved storages no step released. The hook is
``simulate(..., subprograms={node index: [Step, ...]})``, run by :func:`run_steps`.
"""

from __future__ import annotations

from itertools import repeat

from gradscope.memory.kernels.layout import layout_clones, reshape_views
from gradscope.memory.kernels.regions import Step
from gradscope.memory.replay.engine import Program, node_extras, numel_bytes, reentrant_nodes
from gradscope.memory.replay.gradients import EXPANDED, OUTPUT_KINDS, READS_EXPANDED, Memory
from gradscope.memory.replay.recompute import recompute_high

__all__ = [
    "Run",
    "hold_saved",
    "seed_gradients",
    "leaf_step",
    "expanded_copy",
    "region_grads",
    "recompute_node",
    "create_region_tensors",
    "after_formula",
    "by_node",
    "shared_leaves",
    "Step",
    "run_steps",
]


class Run:
    """One replay's inputs, read at every node, and the totals it adds up (see ``simulate``'s arguments)."""

    __slots__ = (
        "prog",
        "mem",
        "buffers",
        "sizes",
        "drop",
        "recompute",
        "grad_scale",
        "has_grad",
        "snapshot_at",
        "release",
        "kind",
        "ext",
        "wsd",
        "track_done",
        "shared",
        "given",
        "created",
        "done",
        "origin",
        "grads_kept",
        "saved_freed",
        "as_view",
        "clones",
        "subs",
    )

    def __init__(
        self,
        prog: Program,
        mem: Memory,
        *,
        sizes,
        drop,
        recompute,
        grad_scale,
        has_grad,
        snapshot_at,
        workspace,
        subprograms=None,
    ) -> None:
        self.prog, self.mem, self.sizes, self.drop = prog, mem, sizes, drop
        self.recompute, self.grad_scale, self.has_grad, self.snapshot_at = recompute, grad_scale, has_grad, snapshot_at
        self.buffers: list = [None] * len(prog.edges)  # per node, its InputBuffer {input nr: tensor} (None: empty)
        self.release = True
        self.kind = list(map(OUTPUT_KINDS.get, prog.name, repeat(0)))  # 0: every output a new tensor
        self.ext = node_extras(prog)
        self.wsd = workspace if workspace is None or type(workspace) is dict else by_node(workspace, prog.leaf)
        self.track_done = bool(recompute)
        self.shared = shared_leaves(prog)  # leaf index -> name, for the parameters traced regions use too
        self.given: set = set()  # parameters whose .grad a traced reentrant region's nested backward set
        self.created: set = set()  # recomputed storage keys made so far
        self.done: set = set()  # nodes that ran (read by the recompute: who still holds a re-created tensor)
        self.origin = mem.origin if snapshot_at is not None else None  # only a snapshot reads who made a gradient
        self.grads_kept = 0  # bytes that ended in .grad (stolen or cloned)
        self.saved_freed = 0
        self.as_view = reshape_views(prog)  # NOTE [gradient layout]: the reshapes that copy, or view a piece
        self.clones = layout_clones(prog)  # gradients AccumulateGrad clones into their parameter's layout
        self.subs = subprograms or None  # node index -> [Step]: NOTE [node sub-programs]


def hold_saved(prog: Program, mem: Memory, sizes: dict, drop) -> None:
    """The saved storages alive when backward starts, one reference per node saving each; a holder outside
    the graph (external) is one more: never freed by backward. Offloaded and recomputed keys are not here."""
    refs0, bytes0, external = mem.st_refs, mem.st_bytes, prog.external
    for keys in prog.saved:
        for key in keys:
            if key in drop or key[0] == "r":
                continue
            n = refs0.get(key)
            if n is None:
                refs0[key] = 2 if key in external else 1
                bytes0[key] = sizes.get(key, 0)
            else:
                refs0[key] = n + 1


def seed_gradients(prog: Program, mem: Memory, buffers: list, held_seeds: bool) -> list:
    """``torch.autograd.backward``'s ``ones_like(root)`` per root, put in the root's InputBuffer and held until
    backward returns (their impl ids). ``held_seeds``: held outside, so not counted and never freed."""
    seeds = []
    for r, nbytes in zip(prog.roots, prog.root_bytes):
        impl = mem.alloc(nbytes)
        seeds.append(mem.ref(impl))
        if buffers[r] is None:
            buffers[r] = {}
        buffers[r][0] = impl
        if held_seeds:
            mem.st_refs[mem.impl_storage[impl]] += 1
            mem.level -= nbytes
    return seeds


def leaf_step(run: Run, v: int, g, level: int, high: int) -> tuple[int, int]:
    """AccumulateGrad ``v`` with incoming gradient ``g`` (or None): stolen when ``.grad`` is None and ``g`` is
    sole-owned, dense and in the parameter's layout, cloned when ``.grad`` is None otherwise, added in place
    when ``.grad`` is set."""
    shared, has_grad = run.shared, run.has_grad
    if g is not None and shared is not None and v in shared:  # a parameter a traced region uses too
        if shared[v] in run.given:
            has_grad = run.has_grad = {**has_grad, v: True}
        run.given.add(shared[v])
    if g is None:
        return level, high
    mem = run.mem
    if (
        not has_grad.get(v)
        and mem.impl_refs.get(g) == 1
        and mem.impl_view.get(g) not in EXPANDED
        and v not in run.clones
    ):
        run.grads_kept += mem.st_bytes.get(mem.impl_storage[g], 0)  # stolen: it becomes .grad
        return level, high
    mem.level, mem.high, mem.cur = level, high, v
    if not has_grad.get(v):  # cloned; else .grad += new_grad, in place
        nbytes = run.prog.grad_bytes[v][0]
        mem.alloc(nbytes)
        run.grads_kept += nbytes
    mem.unref(g)
    return mem.level, mem.high


def expanded_copy(run: Run, v: int, es: list, g) -> int:
    """Bytes of the dense copy of ``sum()``'s expanded gradient ``g`` that ``v``'s formula makes, freed before it
    returns (NOTE [what one node does to memory]); a custom Function's backward is measured on the expanded
    gradient itself (memory/kernels/signature.py), so its copy, if any, is in the measurement."""
    prog, grad_scale = run.prog, run.grad_scale
    gbytes = prog.grad_bytes[v]
    if g is None or not gbytes or prog.name[v] in READS_EXPANDED or run.mem.impl_view.get(g) not in EXPANDED:
        return 0
    if prog.attrs[v].get("function"):
        return 0
    nbytes = gbytes[0] if grad_scale is None else grad_scale(v, 0, gbytes[0])
    return nbytes - after_formula(prog, v, es, grad_scale)


def region_grads(run: Run, v: int, region_params: list, level: int, high: int) -> tuple[int, int]:
    """A reentrant checkpoint node whose region is not modelled: the nested backward fills the ``.grad`` of
    the region's parameters that had none."""
    mem = run.mem
    mem.level, mem.high, mem.cur = level, high, v
    for shape, dtype, had, *_ in region_params:
        if not had:
            nbytes = numel_bytes(shape, dtype)
            mem.alloc(nbytes)
            run.grads_kept += nbytes
    return mem.level, mem.high


def recompute_node(
    prog: Program, mem: Memory, v: int, fresh: list, sizes: dict, drop, created: set, done: set, grad_scale=None
) -> None:
    """Node ``v`` of a checkpoint region runs: the region's tensors in ``fresh`` (``[(key, bytes)]``) not
    made yet are re-created, each held by the region's nodes that save it and have not run; the recompute's
    temporaries raise the node's highest point (NOTE [recompute step by step])."""
    rkeys = dict.fromkeys(key[1] for key, _ in fresh if key not in created and key not in drop)
    for rkey in rkeys:  # one region after the other: each one's highest point above what the others left
        top = recompute_high(prog, rkey, sizes, grad_scale)
        if top:
            mem.high = max(mem.high, mem.level + top)
        create_region_tensors(prog, mem, v, [kb for kb in fresh if kb[0][1] == rkey], sizes, drop, created, done)


def create_region_tensors(
    prog: Program, mem: Memory, v: int, fresh: list, sizes: dict, drop, created: set, done: set
) -> None:
    saved, st_refs = prog.saved, mem.st_refs
    for key, nbytes in fresh:
        if key not in created and key not in drop:
            created.add(key)
            nbytes = sizes.get(key, nbytes)
            holders = sum(1 for u in prog.regions.get(key[1], ()) if key in saved[u] and (u == v or u not in done))
            if not holders:  # re-created and dropped inside the recompute
                mem.high = max(mem.high, mem.level + nbytes)
                continue
            mem.hold_storage(key, nbytes, allocate=True)
            st_refs[key] = holders


def after_formula(prog: Program, v: int, es: list, grad_scale) -> int:
    """Bytes of ``v``'s outputs made after its formula returned, so after the kernel's copy of an expanded
    gradient is gone: ``addmm``'s ``self`` (bias) gradient is the incoming gradient itself, which the
    engine then sums to the bias's shape."""
    if prog.name[v] != "AddmmBackward0":
        return 0
    for (u, k), pos in zip(es, prog.needs[v]):
        if pos == 0:
            nbytes = prog.grad_bytes[u][k] if k < len(prog.grad_bytes[u]) else 0
            return grad_scale(u, k, nbytes) if grad_scale is not None else nbytes
    return 0


def by_node(workspace, leaf: list) -> dict:
    """``{node index: bytes}`` of a ``workspace(node index)`` callable, over the op nodes."""
    return {v: w for v, lf in enumerate(leaf) if not lf and (w := workspace(v))}


def shared_leaves(prog: Program) -> dict | None:
    """Leaf index -> name of the parameters that the graph and a traced reentrant region both use (their
    ``.grad`` is set by whichever backward reaches them first), or None (cached on the program)."""
    got = prog.__dict__.get("_shared_leaves", 0)
    if got != 0:
        return got
    from gradscope.memory.replay.traced import region_params

    names: set = set()
    for _, extra in reentrant_nodes(prog):
        names |= region_params(extra.get("region_recompute") or {})
    found = {i: n for i, (kind, n) in prog.leaves().items() if kind == "param" and n in names} if names else {}
    prog.__dict__["_shared_leaves"] = found or None
    return found or None


def run_steps(run, v: int, steps: list, inputs: dict, level: int, high: int) -> tuple[int, int, set]:
    """Run node ``v``'s ``steps`` (``run``: the replay's ``steps.Run``) from ``level``: ``(level, high,
    released)``, the level without what the steps left (the node's outputs, made next by the engine's usual
    step) and the saved keys let go. At a snapshot node, ``mem.snap`` gets what is alive at the node's
    highest point (the node's own bytes under ``("w", v)``)."""
    mem, release, snapshot = run.mem, run.release, v == run.snapshot_at
    st_refs, st_bytes = mem.st_refs, mem.st_bytes
    own = 0
    released: set = set()
    copied: set = set()
    view = mem.impl_view
    gone: list = []  # incoming gradients the region's argument list let go of (NOTE [compiled region memory])
    for step in steps:
        for j, b in step.copy:
            g = inputs.get(j)
            if g is None or (view and view.get(g) in EXPANDED):  # materialized as zeros, or made dense
                copied.add(j)
                own += b
                level += b
                level = _let_go(mem, inputs, j, level, gone)  # the expanded original: the list is cleared
        own += step.alloc
        level += step.alloc
        if level + step.workspace > high:
            high = level + step.workspace
            if snapshot:
                mem.snap = {**st_bytes, ("w", v): own + step.workspace}
        own -= step.free
        level -= step.free
        for j, b in step.uncopy:
            if j in copied:
                own -= b
                level -= b
            else:  # a dense incoming gradient dies at its last use too
                level = _let_go(mem, inputs, j, level, gone)
        if release:
            for k in step.release:
                released.add(k)
                n = st_refs.get(k)
                if n is None:
                    continue
                if n > 1:
                    st_refs[k] = n - 1
                else:
                    del st_refs[k]
                    freed = st_bytes.pop(k, 0)
                    level -= freed
                    run.saved_freed += freed
    for j in gone:
        del inputs[j]  # not dropped again when the node returns
    return level - own, high, released


def _let_go(mem, inputs: dict, j: int, level: int, gone: list) -> int:
    """Incoming gradient ``j`` of a region node is dropped now (one reference; freed when nothing else holds
    it): torch 2.13 hands the compiled backward its gradients as one list that the prologue clears."""
    g = inputs.get(j)
    if g is None or j in gone:
        return level
    gone.append(j)
    mem.level = level
    mem.unref(g)
    return mem.level
