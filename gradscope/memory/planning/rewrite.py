"""A what-if's checkpoint regions written into the replay's compiled program (``engine.Program``).

NOTE [a requested checkpoint region]
Under ``checkpoint(fn, *args, use_reentrant=False)`` every tensor that ``fn``'s ops save becomes a holder
with no data; the frame keeps ``args``. In backward, the first unpack of any holder re-runs ``fn`` and
re-creates every saved tensor of the region at once (early stop ends the recompute once the last one is
back); each lives until the last node that saved it has run, and the frame (with ``args``) dies with the
region's last holder. So, per region ``R`` (one module call):

- a storage saved inside ``R`` that is a region input (``select.region_inputs``) or held outside the graph
  (a parameter, the user's batch) is not recomputed: it stays, and the frame holds it until ``R``'s last
  node has run (every node of ``R`` holds it); so does an input that a dtype change left unsaved
  (``Program.unheld``: in bfloat16, RMSNorm saves a float32 copy of its input, and only the frame keeps
  the input itself);
- an input of ``R`` that no node saved is held by the frame too: a new storage of its size (its gradient's
  bytes, so in the replayed dtype), held the same way; so is the CPU RNG state that
  ``preserve_rng_state=True`` (the default) saves per call (``torch.get_rng_state()``, 5056 bytes; on the
  CPU only: it lives in host memory);
- every other storage saved inside ``R`` gets a recomputed copy (key ``("r", region, key)``) that the
  nodes of ``R`` hold instead; the first node of ``R`` that backward runs creates all of them (it holds
  each once, so each is freed after its last saver). The original stays only where a node outside ``R``
  saved it too.

The program is copied; the report's cached one is not changed.
"""

from __future__ import annotations

from dataclasses import replace

from gradscope.memory.planning.select import region_inputs
from gradscope.memory.replay.engine import engine_order, numel_bytes

__all__ = ["with_checkpoints"]


def _rng_bytes() -> int:
    import torch

    return int(torch.get_rng_state().numel())


def with_checkpoints(prog, graph, regions: list[tuple[str, list[str]]], device: str = "cpu", rank=None):
    """A copy of ``prog`` with each ``(module, node ids)`` region checkpointed (NOTE [a requested
    checkpoint region]); ``rank``: node index -> position in the engine order, when at hand."""
    if not regions:
        return prog
    index = prog.index
    saved = [list(keys) for keys in prog.saved]
    storages = dict(prog.storages)
    shapes = dict(prog.shapes)
    recompute = {k: list(v) for k, v in prog.recompute.items()}
    prog_regions = dict(prog.regions)
    rank = {v: i for i, v in enumerate(engine_order(prog))} if rank is None else rank
    for r, (module, nids) in enumerate(regions):
        members = [index[n] for n in nids if n in index]
        if not members:
            continue
        inside = set(members)
        inputs, unsaved = region_inputs(graph, nids)
        kept = set(inputs) | prog.external
        rkey = ("w", r, module)
        first = min(members, key=lambda v: rank.get(v, len(rank)))
        fresh = []
        for v in members:
            new = []
            for key in saved[v]:
                if key in kept or key[0] == "r":
                    new.append(key)
                    continue
                copy = ("r", rkey, key)
                if copy not in storages:
                    storages[copy] = prog.storages.get(key, 0)
                    shapes[copy] = prog.shapes.get(key)
                    fresh.append((copy, storages[copy]))
                if copy not in new:
                    new.append(copy)
            saved[v] = new
        for u, k in unsaved:  # inputs only the frame keeps
            d = graph.nodes[u]
            shape = (d.get("out_shapes") or [[]])[k]
            key = ("f", rkey, u, k)
            sizes = prog.grad_bytes[index[u]] if u in index else ()  # the output's bytes in the program's dtype
            storages[key] = sizes[k] if k < len(sizes) and sizes[k] else numel_bytes(shape, _dtype(d))
            shapes[key] = shape
            inputs = set(inputs) | {key}
        if device == "cpu":
            key = ("f", rkey, "rng")
            storages[key] = _rng_bytes()
            shapes[key] = None
            inputs = set(inputs) | {key}
        for key in set(inputs) - set(storages):  # no node saves it after a dtype change: the frame still does
            if key in prog.unheld:
                storages[key] = prog.unheld[key]
        frame = [key for key in inputs if key in storages]
        for v in members:  # the frame: held until the region's last node ran
            saved[v].extend(key for key in frame if key not in saved[v])
        for copy, _ in fresh:  # the first node to run creates and holds each once
            if copy not in saved[first]:
                saved[first].append(copy)
        recompute[first] = recompute.get(first, []) + fresh
        prog_regions[rkey] = inside
    keys_left = {k for keys in saved for k in keys}
    storages = {k: b for k, b in storages.items() if k in keys_left}
    return replace(
        prog,
        saved=[tuple(s) for s in saved],
        storages=storages,
        shapes=shapes,
        recompute=recompute,
        regions=prog_regions,
    )


def _dtype(d) -> str:
    for e in d.get("saved") or ():
        if e.get("dtype") and str(e["dtype"]).startswith(("float", "bfloat")):
            return e["dtype"]
    return "float32"


def with_offload(prog, nodes):
    """A copy of ``prog`` with the saved tensors of op nodes ``nodes`` (ids) under ``save_on_cpu()`` on an
    accelerator: a storage only those nodes saved leaves the device until backward (a parameter or a tensor
    held outside the graph stays); each node's unpack (``tensor.to(device)``) makes a device copy that lives
    while the node runs (key ``("r", ("o", node), key)``, created and freed by that node alone)."""
    index = prog.index
    off = {index[n] for n in nodes if n in index}
    if not off:
        return prog
    saved = [list(keys) for keys in prog.saved]
    storages = dict(prog.storages)
    shapes = dict(prog.shapes)
    recompute = {k: list(v) for k, v in prog.recompute.items()}
    regions = dict(prog.regions)
    for v in sorted(off):
        rid = ("o", v)
        new, fresh = [], []
        for key in saved[v]:
            if key in prog.external or key[0] == "r":
                new.append(key)
                continue
            copy = ("r", rid, key)
            storages[copy] = prog.storages.get(key, 0)
            shapes[copy] = prog.shapes.get(key)
            new.append(copy)
            fresh.append((copy, storages[copy]))
        saved[v] = new
        if fresh:
            recompute[v] = recompute.get(v, []) + fresh
            regions[rid] = {v}
    keys_left = {k for keys in saved for k in keys}
    storages = {k: b for k, b in storages.items() if k in keys_left}
    return replace(
        prog, saved=[tuple(s) for s in saved], storages=storages, shapes=shapes, recompute=recompute, regions=regions
    )
