"""A node whose backward is a program of its own, replayed in place when the engine reaches it
(NOTE [node sub-programs]).

NOTE [node sub-programs] (docs/memory.md#compiled-regions)
Most nodes run one formula: outputs, then workspace freed before they return (simulate.py NOTE [what one
node does to memory]). A node that runs a whole graph of ops, a ``torch.compile`` region
(``CompiledFunctionBackward``, whose steps the walk reads from its backward graph: walk/regionmem.py NOTE
[compiled region memory]) or a custom ``autograd.Function`` traced on fake tensors, instead gives the
replay a list of :class:`Step`, one per op in the order its code runs them: the bytes the op allocates,
the bytes of the node's own temporaries that die after it, and the saved storages whose last use inside
the node it was (one reference each, freed when nothing else holds them: shared storages and
``retain_graph=True`` are the replay's business, as for any node). At the node the replay runs the steps
on its level (the node's highest point is the highest step), takes off what the steps left (the output
gradients, which the engine's usual step then makes per edge, so views, stealing and InputBuffer sums
stay as for any node) and releases the saved storages no step released. The hook is
``simulate(..., subprograms={node index: [Step, ...]})``; :func:`from_region` builds the steps of a
compiled region.
"""

from __future__ import annotations

from typing import NamedTuple

from gradscope.memory.replay.gradients import EXPANDED

__all__ = ["Step", "from_region", "run_steps", "region_subprograms", "fused_note", "STEPS", "UNREAD", "UPPER"]

#: The words a note carries when the peak is an upper bound.
UPPER = "upper bound"

#: The node attributes (in ``attrs``) the walk writes for a compiled region (walk/regionmem.py): its steps,
#: or why it has none.
STEPS = "region_steps"
UNREAD = "region_unread"


class Step(NamedTuple):
    """One op of a node's own program."""

    alloc: int = 0  # bytes the op allocates and keeps (its outputs)
    free: int = 0  # bytes of the node's temporaries freed after it
    release: tuple = ()  # saved storage keys ("s", storage id) whose last use inside the node this was
    workspace: int = 0  # bytes the op allocates and frees before it returns
    copy: tuple = ()  # (input nr, bytes): a dense copy of that incoming gradient made here when it is expanded
    uncopy: tuple = ()  # (input nr, bytes): that copy freed after this step


def _sized(nbytes, shape, dtype, scale, alloc) -> int:
    b = int(scale(shape, dtype, nbytes)) if scale is not None else int(nbytes)
    return alloc(b) if alloc is not None else b


def from_region(region: dict, workspaces: list, scale=None, alloc=None) -> list[Step]:
    """The steps of a compiled region from the walk's plain data (``[allocs, frees, releases, call]`` per op,
    see walk/regionmem.py) and each op's measured ``workspaces`` (bytes at the op's full size, or None);
    ``scale(shape, dtype, nbytes)`` resizes each allocation (a what-if batch; a workspace scales with the
    op's outputs) and ``alloc(nbytes)`` rounds it as a device's allocator does."""
    data = region["steps"]
    tangents = [(j, _sized(t[0], t[1], t[2], scale, alloc)) for j, t in enumerate(region["tangents"])]
    sizes: list[int] = []
    steps: list[Step] = []
    for (allocs, frees, releases, _, dead), ws in zip(data, workspaces):
        total = full = 0
        for nbytes, shape, dtype in allocs:
            b = int(scale(shape, dtype, nbytes)) if scale is not None else int(nbytes)
            if alloc is not None:
                b = alloc(b)
            sizes.append(b)
            total += b
            full += int(nbytes)
        w = int(ws or 0)
        if w and scale is not None and full:
            w = int(round(w * total / full))
        if w and alloc is not None:
            w = alloc(w)
        copy = tuple(tangents) if not steps else ()
        uncopy = tuple(tangents[j] for j in dead)
        steps.append(Step(total, sum(sizes[j] for j in frees), tuple(("s", s) for s in releases), w, copy, uncopy))
    return steps


def region_subprograms(prog, extras: list, scale=None, alloc=None) -> tuple[dict, dict, set]:
    """``({node index: [Step, ...]}, {node index: why it is a lower bound}, fused)`` for every node whose attrs
    carry region steps (a region whose steps could not be read is in the second dict only; ``fused``: the
    regions inductor lowered, whose replayed peak is an upper bound)."""
    from gradscope.memory.kernels.fxops import call_workspaces

    cached = prog.__dict__.setdefault("_region_workspaces", {})
    out, why = {}, {}
    fused: set = set()
    for v, d in enumerate(extras):
        if d is None:
            continue
        if d.get(UNREAD) is not None:
            why[v] = f"the memory inside this compiled region is not known: {d[UNREAD]}"
            continue
        region = d.get(STEPS)
        if region is None:
            continue
        data = region["steps"]
        got = cached.get(v)
        if got is None:
            calls = [(i, st[3]) for i, st in enumerate(data) if st[3] is not None]
            ws, missed = call_workspaces([c for _, c in calls])
            per = [None] * len(data)
            for (i, _), w in zip(calls, ws):
                per[i] = w
            unknown = [calls[j][1][0] for j in missed] + [
                "a call that cannot run alone" for st in data if st[0] and st[3] is None
            ]
            got = (per, unknown, next(iter(missed.values()), None))
            if not missed:  # a failure is tried again next time
                cached[v] = got
        per, unknown, reason = got
        out[v] = from_region(region, per, scale, alloc)
        if region.get("fused"):
            fused.add(v)
        if unknown:
            why[v] = (
                f"the workspace of {len(unknown)} op(s) inside this compiled region is not known "
                f"({', '.join(sorted(set(unknown))[:3])}{': ' + reason if reason else ''})"
            )
    return out, why, fused


def fused_note(n: int) -> str:
    """The printed sentence for ``n`` regions inductor lowered."""
    return (
        f"{n} compiled region(s) run inductor's fused kernels: replayed op by op from the backward graph, "
        "the peak is an upper bound (fused code keeps fewer intermediates; measured +0% to +115% on small models)"
    )


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
    for step in steps:
        for j, b in step.copy:
            if view and view.get(inputs.get(j)) in EXPANDED:
                copied.add(j)
                own += b
                level += b
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
    return level - own, high, released
