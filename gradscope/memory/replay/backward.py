"""``report.backward_memory()``: what ``backward()`` (and ``optimizer.step()``) will allocate, before it runs.

Nothing runs and nothing is allocated: the replay reads ``report.graph`` (metadata only) and applies the
engine's rules (``engine.py`` NOTE [engine order], ``simulate.py`` NOTE [what one node does to memory]).

Internal API (for what-if planning)
-----------------------------------
::

    from gradscope.memory.replay.backward import replay, Overrides

    res = replay(report, Overrides(...), optimizer=None, retain_graph=False)
    res.order, res.levels, res.peak, res.peak_node, res.end   # as BackwardMemory (node ids, bytes)
    res.base           # bytes alive when backward starts (parameters, buffers, inputs, saved tensors,
                       #   .grads and optimizer state of earlier steps, the loss)
    res.absolute_peak  # the "absolute peak": base + the highest level up to the end of backward,
                       #   or of optimizer.step() when an optimizer is given
    res.step           # StepBudget or None (optimizer.py)

``Overrides`` (all optional, all by node id / storage key, so modules are the caller's business; use
``module_nodes(report, patterns)`` to turn qualified names or fnmatch patterns into node ids):

- ``offload``: node ids whose saved tensors are kept off the device (``save_on_cpu``): their storages are
  neither in ``base`` nor freed by backward (a storage also saved by a node outside the set stays).
- requested checkpoint regions are written into a copy of the compiled program (``program(report)``,
  an ``engine.Program``): each region node's ``saved`` keys, ``storages``/``shapes`` for the re-created
  copies, ``recompute[node] = [(key, bytes)]`` (created at the first of those nodes that runs, each held by
  the region's nodes that list it in ``saved``) and ``regions[key[1]] = node indices``; see
  ``rewrite.with_checkpoints``. Regions the graph already has are read the same way (``regions.py``).
- ``scale``: a callable ``(shape: list[int], dtype: str, nbytes: int) -> int`` applied to every storage
  and gradient size (e.g. ``batch_scale(k, batch)`` scales tensors whose leading dim is the batch).
- ``has_grad``: ``{param name: bool}`` overriding whether ``.grad`` is already set.
- ``target``: a ``gradscope.memory.targets.Target`` (None: the CPU): each storage and gradient counted as
  that device's allocator counts it, its fixed workspaces and optimizer implementation (NOTE [device targets]).

The same function serves ``report.backward_memory()``: ``BackwardMemory`` is ``replay(report)`` with node
ids, modules and locations filled in.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import gc
import weakref
from typing import Any

from gradscope.errors import InputTypeError, InputValueError
from gradscope.findings import FREED_GRAPH
from gradscope.memory.kernels.regions import fused_note, region_subprograms
from gradscope.memory.kernels.workspace import InNode, innode, scaled
from gradscope.memory.replay.accounting import (
    Overrides,
    grad_names,
    offloaded_keys,
    storage_sizes,
)
from gradscope.memory.replay.compile import PROGRAM_KEY, Lazy, program
from gradscope.memory.replay.engine import Program, node_extras, reentrant_nodes
from gradscope.memory.replay.gradients import VIEW_OPS
from gradscope.memory.replay.optimizer import step_budget
from gradscope.memory.replay.replayed import Replayed
from gradscope.memory.replay.result import BackwardMemory
from gradscope.memory.replay.simulate import Trace, simulate
from gradscope.memory.replay.steady import grad_variants
from gradscope.memory.targets import Target, resolve

__all__ = [
    "BackwardMemory",
    "Overrides",
    "replay",
    "backward_memory",
    "check_steps",
    "module_nodes",
    "batch_scale",
    "program",
    "PROGRAM_KEY",
]


_NO_OVERRIDES = Overrides()


def module_nodes(report, patterns) -> set:
    """Op node ids whose module matches one of ``patterns`` (qualified names or fnmatch patterns; a name
    also matches its submodules)."""
    if isinstance(patterns, str):
        patterns = [patterns]
    prog = program(report)
    out = set()
    for i, mod in enumerate(prog.module):
        if mod is None or prog.leaf[i]:
            continue
        for p in patterns:
            if fnmatch.fnmatchcase(mod, p) or mod.startswith(p + ".") or fnmatch.fnmatchcase(mod, p + ".*"):
                out.add(prog.ids[i])
                break
    return out


def batch_scale(k: float, batch: int):
    """A ``scale`` override: tensors whose leading dimension is ``batch`` grow by ``k``."""

    def scale(shape, dtype, nbytes):
        if shape and int(shape[0]) == batch:
            return int(round(nbytes * k))
        return nbytes

    return scale


def _check_graph(report) -> None:
    freed = [f for f in getattr(report, "findings", ()) if f.kind == FREED_GRAPH]
    if freed:
        raise InputValueError(
            "backward_memory() needs a graph that backward() has not freed yet: its saved tensors are gone. "
            "Call gradscope.inspect(loss) before loss.backward(), or keep the graph with "
            "backward(retain_graph=True)."
        )


def replay(
    report,
    overrides: Overrides | None = None,
    *,
    optimizer=None,
    retain_graph: bool = False,
    workspace: bool = True,
    run_custom: bool = False,
    inputs=None,
) -> BackwardMemory:
    """Replay backward (and the optimizer step) over ``report``'s graph with ``overrides`` applied.

    ``inputs``: the caller's batch (tensors, or lists / dicts of them), alive through the step: counted in
    the budget once, unless an op saved it or it is an input leaf (see :func:`accounting.batch_bytes`).
    See the module docstring for the fields; raises :class:`InputTypeError` for an optimizer that is not a
    ``torch.optim.Optimizer`` and :class:`InputValueError` for a graph already freed by backward.
    """
    _check_graph(report)
    _check_optimizer(optimizer)
    ov = overrides or _NO_OVERRIDES
    prog = program(report)
    graph = report.peek_graph() if hasattr(report, "peek_graph") else report.graph  # no DiGraph needed
    target = resolve(ov.target)
    alloc = None if type(target).allocated is Target.allocated else target.allocated  # CPU: bytes as asked
    sizes, grad_scale = storage_sizes(prog, ov.scale, alloc)
    if alloc is not None:  # the seed gradient (ones_like(loss)) is a block of the device's allocator too
        prog = dataclasses.replace(prog, root_bytes=[alloc(b) for b in prog.root_bytes])
    drop = offloaded_keys(prog, ov)
    has_grad = _has_grad(prog, ov)
    subs, partial, fused = region_subprograms(prog, node_extras(prog), ov.scale, alloc)  # NOTE [node sub-programs]
    inn = _innode(prog, run_custom, subs, partial) if workspace else InNode()
    if fused - set(partial):
        inn = dataclasses.replace(inn, notes=(*inn.notes, fused_note(len(fused - set(partial)))))
    ws = {v: (alloc(w) if alloc else w) for v in inn.bytes if (w := scaled(inn, v, grad_scale))}
    sim = functools.partial(
        simulate,
        prog,
        retain_graph=retain_graph,
        has_grad=has_grad,
        storage_bytes=sizes,
        grad_scale=grad_scale,
        workspace=ws or None,
        drop=drop,
        subprograms=subs or None,
    )
    tr: Trace = sim()
    step = later = None
    high = tr.peak
    variants = grad_variants(prog, has_grad)
    if optimizer is not None:  # read now: the optimizer's state changes with every step
        step = step_budget(
            optimizer,
            graph,
            has_grad_names=grad_names(prog, has_grad),
            after=tr.end,
            target=None if ov.target is None else target,
        )
        high = max(high, tr.end + step.peak)
        later = step_budget(
            optimizer,
            graph,
            has_grad_names=grad_names(prog, variants[1]),
            target=None if ov.target is None else target,
            later=True,
        )
    run = Replayed(prog, graph, tr, sim, sizes, drop, has_grad, ov, alloc, target, inputs, step, inn, ws, high)
    run.later_budget, run.variants = later, variants
    run.ptrs = getattr(report, "storage_ptrs", None)
    run.steps()  # NOTE [first and later steps]: simulated now, as the optimizer's state is read now
    try:
        ref = weakref.ref(report)
    except TypeError:
        ref = None
    ids = prog.ids
    return BackwardMemory._deferred(
        run.fields,
        _contributors=run.contributors,
        _report=ref,
        target=target,
        order=list(map(ids.__getitem__, tr.order)),
        levels=tr.levels,  # the trace's own lists: nothing else keeps or changes them
        peak=tr.peak,
        peak_node=None if tr.peak_at is None else ids[tr.peak_at],
        end=tr.end,
        step=step,
        modules=Lazy(lambda: [prog.module[v] for v in tr.order]),
        inner=tr.inner,
        locations=_locations(prog, tr),
    )


def check_steps(accumulate, set_to_none) -> int:
    """``accumulate`` as an int of at least 1, or one sentence why not."""
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise InputValueError(
            f"accumulate= is the number of backward passes per optimizer.step() (an int of at least 1), "
            f"got {accumulate!r}."
        )
    if not isinstance(set_to_none, bool):
        raise InputTypeError(
            f"set_to_none= says how zero_grad() clears .grad (True or False), got {type(set_to_none).__name__}."
        )
    return accumulate


def _check_optimizer(optimizer) -> None:
    if optimizer is not None:
        import torch

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InputTypeError(
                f"optimizer= must be a torch.optim.Optimizer (e.g. torch.optim.AdamW(model.parameters())), "
                f"got {type(optimizer).__name__}."
            )


def _has_grad(prog: Program, ov: Overrides) -> dict:
    """Leaf index -> whether ``.grad`` is set: as inspected (read-only), or a copy with ``ov.has_grad`` applied."""
    has_grad = prog.has_grad
    if ov.has_grad:
        has_grad = dict(has_grad)
        for i, (_, name) in prog.leaves().items():
            if name in ov.has_grad:
                has_grad[i] = bool(ov.has_grad[name])
    return has_grad


def _locations(prog: Program, tr: Trace) -> dict:
    """Node id -> source line of the nodes that have one, in the engine's order."""
    ids = prog.ids
    locs = {}
    built = getattr(prog.attrs, "built_dicts", None)  # compact: only dicts already made (a trace makes every op's)
    dicts: Any = prog.attrs if built is None else built()
    if built is not None:  # the few dicts made: their locations, then in the engine's order
        found = {v: d["location"] for v, d in dicts.items() if d.get("location")}
        if found:
            locs = {ids[v]: found[v] for v in tr.order if v in found}
    elif dicts:
        for v in tr.order:
            loc = dicts[v].get("location")
            if loc:
                locs[ids[v]] = loc
    return locs


def _innode(prog: Program, run_custom: bool, subs: dict, partial: dict) -> InNode:
    """In-node memory of every op node but views (their gradient is a view of the incoming one), reentrant
    checkpoint regions (their recompute and nested backward: reentrant.py, or listed as unmodelled) and nodes
    replayed as a sub-program of their own (NOTE [node sub-programs])."""
    regions = {v for v, _ in reentrant_nodes(prog)} | set(subs) | set(partial)
    nodes = [
        v
        for v, (lf, name) in enumerate(zip(prog.leaf, prog.name))
        if not lf and name not in VIEW_OPS and v not in regions
    ]
    inn = innode(prog, nodes, run_custom)
    if partial:  # a region whose steps or some op's workspace are not known: a lower bound, said why
        inn = dataclasses.replace(inn, unmodelled={**inn.unmodelled, **partial})
    return inn


def backward_memory(
    report,
    retain_graph: bool = False,
    optimizer=None,
    inputs=None,
    target=None,
    run_custom: bool = False,
    accumulate: int = 1,
    set_to_none: bool = True,
) -> BackwardMemory:
    """``report.backward_memory()``: the unchanged step (see :class:`BackwardMemory`); ``inputs``: the batch
    the caller holds through the step, for the absolute peak (:func:`replay`); ``target``: the device
    (``"cpu"`` by default, ``"cuda"`` or a Target: NOTE [device targets]); custom autograd.Functions' backward
    runs on fake tensors to measure their in-node memory (``run_custom=True``: on real random tensors);
    ``accumulate``: backward passes per ``optimizer.step()`` (gradient accumulation), ``set_to_none``: how
    ``zero_grad()`` clears ``.grad`` between steps (replay/steady.py NOTE [first and later steps])."""
    accumulate = check_steps(accumulate, set_to_none)
    ov = None
    if target is not None or accumulate != 1 or not set_to_none:
        ov = Overrides(
            target=None if target is None else resolve(target), accumulate=accumulate, set_to_none=set_to_none
        )
    enabled = gc.isenabled()
    gc.disable()  # the replay allocates many small objects; generational passes would dominate its time
    try:
        return replay(report, ov, optimizer=optimizer, retain_graph=retain_graph, inputs=inputs, run_custom=run_custom)
    finally:
        if enabled:
            gc.enable()
