"""A traced reentrant checkpoint region's recompute and nested backward, from its rebuilt meta graph.

NOTE [traced reentrant regions]
When the forward ran under ``gradscope.trace()``, a reentrant region's node carries the recording of its
calls (``tracing/regions.py``); ``walk/recompute.py`` replays them on ``meta`` and walks the graph they
make, the one ``CheckpointFunction.backward`` will build. From it, as for the layers of
``memory/replay/reentrant.py`` (same :class:`~gradscope.memory.reentrant.NestedEffect`, same engine rules):

- the recompute's forward: after each call, the storages of the values its function still holds (the
  forward's own Python lifetimes, recorded by the trace) plus the storages the new graph saved so far (a
  saved storage counts from the call that made the node saving it), the inputs', parameters' and outside
  tensors' storages left out (they exist already), the RNG state copy of ``fork_rng`` on top. Not seen:
  temporaries that one call (``F.scaled_dot_product_attention``'s math path, ``F.layer_norm``) makes and
  frees inside itself;
- the nested backward: ``replay.simulate`` over the compiled graph, its seeds being the outer node's
  incoming gradients (allocated already, held by the outer engine: never stolen, never freed here), each
  parameter's AccumulateGrad with ``.grad`` set or not as the parameter had it when inspected;
- the region's outputs die when the node returns.
"""

from __future__ import annotations

import json

from gradscope.memory.replay.compile import compile_records
from gradscope.walk.recompute import rebuild

__all__ = ["traced_effect", "usable"]


def usable(recompute: dict) -> bool:
    """Whether the node's ``region_recompute`` holds a recording the replay can use."""
    rec = recompute.get("traced") or {}
    return rec.get("reason") is None and bool(rec.get("calls"))


def region_params(recompute: dict) -> set:
    """Names of the parameters that require grad among those a traced region uses."""
    return {p[1] for p in (recompute.get("traced") or {}).get("params") or () if p[2][3]}


def traced_effect(recompute: dict, simulate, given: frozenset = frozenset()) -> dict | None:
    """The fields of the :class:`~gradscope.memory.reentrant.NestedEffect` of a traced region, or None (and
    the reason in ``recompute["traced"]["replay"]``) when its recording cannot be replayed on meta. The
    parameters named in ``given`` have a ``.grad`` by then (set earlier in the same backward)."""
    rec = recompute["traced"]
    key = _digest(recompute, given)
    hit = _MEMO.get(key)  # a repeated block: the same calls on the same shapes, its parameters aside
    if hit is None:
        if len(_MEMO) >= 256:
            _MEMO.clear()
        hit = _MEMO[key] = (_effect(recompute, simulate, given), rec.get("replay"))
    if hit[1] is not None:
        rec["replay"] = hit[1]
    return hit[0]


_MEMO: dict = {}


def _digest(recompute: dict, given: frozenset) -> str:
    """The recording as a string, each parameter named by its position (blocks alike share the result)."""
    rec = recompute["traced"]
    pos = {p[0]: i for i, p in enumerate(rec["params"])}

    def norm(v):
        if isinstance(v, list):
            if len(v) > 2 and v[0] == "T" and v[1] == "p":
                return ["T", "p", pos.get(v[2]), *v[3:]]
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v

    params = [[p[2], p[3] or p[1] in given] for p in rec["params"]]
    parts = [norm(rec["calls"]), rec["inputs"], rec["deaths"], rec["outputs"], params]
    return json.dumps([*parts, recompute.get("rng_bytes")], sort_keys=True)


def _effect(recompute: dict, simulate, given: frozenset) -> dict | None:
    rec = recompute["traced"]
    built = rebuild(rec)
    if isinstance(built, str):
        rec["replay"] = built
        return None
    built.has_grad.update(dict.fromkeys(given, True))
    prog = compile_records(built.records, built.ids, dict)
    _cpu_names(prog, rec["calls"], built.seq_ranges)
    for i, (kind, name) in prog.leaves().items():
        if kind == "param":
            prog.has_grad[i] = bool(built.has_grad.get(name))
    tr = simulate(prog, held_seeds=True)
    first = _saved_from(prog, built.seq_ranges)
    sizes = {**prog.storages, **built.outputs}

    def level(live: dict, i: int) -> int:
        keys = set(live) | {k for k, c in first.items() if c <= i}
        return sum(live.get(k) or sizes.get(k, 0) for k in keys - built.pre)

    high = max((level(after, i) for i, (after, _) in enumerate(built.steps)), default=0)
    kept = sum(sizes.get(k, 0) for k in (set(first) | set(built.outputs)) - built.pre)
    out_bytes = sum(n for k, n in built.outputs.items() if k not in built.pre)
    rng = int(recompute.get("rng_bytes") or 0)
    return {
        "forward_peak": rng + max(high, kept),
        "peak": kept + tr.peak,
        "end": kept + tr.end - out_bytes,
        "input_grad": built.input_grad,
        "grads_kept": tr.grads_kept - built.input_grad,
        "names": tuple(prog.name[v] for v in tr.order),
    }


#: Calls whose view of a non-contiguous tensor is, on CPU, ``_reshape_alias`` (``ReshapeAliasBackward0``);
#: a meta tensor counts as a tensor subclass there (``isTensorSubclassLike``) and gets ``view``
#: (``ViewBackward0``), as a contiguous one does on CPU: same memory, same order.
_RESHAPES = frozenset({"reshape", "reshape_as", "flatten"})


def _contiguous(shape, stride) -> bool:
    expect = 1
    for n, s in reversed(list(zip(shape, stride))):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _cpu_names(prog, calls: list, ranges: list) -> None:
    """Name the nodes as the CPU recompute will (the order and the bytes do not change)."""
    for c, call in enumerate(calls):
        arg = call[1][0] if call[1] else None
        if not (isinstance(arg, list) and arg[0] == "T") or _contiguous(arg[3], arg[4]):
            continue
        if call[0][-1].rsplit(".", 1)[-1] in _RESHAPES and ranges[c].stop > ranges[c].start:
            for v, s in enumerate(prog.seq):
                if s in ranges[c] and prog.name[v] == "ViewBackward0" and not prog.leaf[v]:
                    prog.name[v] = "ReshapeAliasBackward0"


def _saved_from(prog, ranges: list) -> dict:
    """Saved storage key -> the first call whose nodes save it."""
    starts = [(r.start, r.stop, c) for c, r in enumerate(ranges) if r.stop > r.start]
    out: dict = {}
    for v, keys in enumerate(prog.saved):
        if not keys or prog.leaf[v]:
            continue
        s = prog.seq[v]
        call = next((c for a, b, c in starts if a <= s < b), len(ranges))
        for k in keys:
            if call < out.get(k, len(ranges) + 1):
                out[k] = call
    return out
