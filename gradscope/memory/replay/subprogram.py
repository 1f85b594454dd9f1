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

__all__ = ["Step", "from_region", "run_steps", "region_subprograms", "STEPS", "UNREAD"]

#: The node attributes (in ``attrs``) the walk writes for a compiled region (walk/regionmem.py): its steps,
#: or why it has none.
STEPS = "region_steps"
UNREAD = "region_unread"


class Step(NamedTuple):
    """One op of a node's own program."""

    alloc: int = 0  # bytes the op allocates
    free: int = 0  # bytes of the node's temporaries freed after it
    release: tuple = ()  # saved storage keys ("s", storage id) whose last use inside the node this was


def from_region(data: list, scale=None, alloc=None) -> list[Step]:
    """The steps of a compiled region from the walk's plain data (``[allocs, frees, releases]`` per op, see
    walk/regionmem.py); ``scale(shape, dtype, nbytes)`` resizes each allocation (a what-if batch) and
    ``alloc(nbytes)`` rounds it as a device's allocator does."""
    sizes: list[int] = []
    steps: list[Step] = []
    for allocs, frees, releases in data:
        total = 0
        for nbytes, shape, dtype in allocs:
            b = int(scale(shape, dtype, nbytes)) if scale is not None else int(nbytes)
            if alloc is not None:
                b = alloc(b)
            sizes.append(b)
            total += b
        steps.append(Step(total, sum(sizes[j] for j in frees), tuple(("s", s) for s in releases)))
    return steps


def region_subprograms(extras: list, scale=None, alloc=None) -> dict:
    """``{node index: [Step, ...]}`` of every node whose attrs carry region steps."""
    out = {}
    for v, d in enumerate(extras):
        if d is not None and d.get(STEPS) is not None:
            out[v] = from_region(d[STEPS], scale, alloc)
    return out


def run_steps(run, v: int, steps: list, level: int, high: int) -> tuple[int, int, set]:
    """Run node ``v``'s ``steps`` (``run``: the replay's ``steps.Run``) from ``level``: ``(level, high,
    released)``, the level without what the steps left (the node's outputs, made next by the engine's usual
    step) and the saved keys let go. At a snapshot node, ``mem.snap`` gets what is alive at the node's
    highest point (the node's own bytes under ``("w", v)``)."""
    mem, release, snapshot = run.mem, run.release, v == run.snapshot_at
    st_refs, st_bytes = mem.st_refs, mem.st_bytes
    own = 0
    released: set = set()
    for step in steps:
        own += step.alloc
        level += step.alloc
        if level > high:
            high = level
            if snapshot:
                mem.snap = {**st_bytes, ("w", v): own}
        own -= step.free
        level -= step.free
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
