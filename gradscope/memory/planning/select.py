"""Which modules a what-if names, which op nodes each module call made, and which tensors scale with the batch.

Pure functions over ``report.graph``, shared by :mod:`gradscope.memory.planning.whatif` and
:mod:`gradscope.memory.planning.plan`.

NOTE [module calls from sequence numbers]
``trace()`` writes the innermost module of every op node (``module``). A module wrapped in ``checkpoint``
makes one recompute region per *call*, and a module may be called several times (a shared block). The op
nodes of one call are contiguous in forward creation order (``seq``); so a module's regions are the maximal
runs, in ``seq`` order, of op nodes inside it. Two calls with no differentiable op between them
(``f(f(x))``) look like one region.

NOTE [what scales with the batch]
Scaling the batch by ``k`` scales a tensor by ``k`` when its shape holds the batch: the batch size ``B``
itself as a dimension (``B×T×C``, ``T×B×C`` for an RNN), or a first dimension ``B·n`` where ``n`` is a
dimension seen next to ``B`` elsewhere in the graph (``B·T×C`` after a ``view`` for a Linear), or a flat
buffer (an RNN workspace) whose size is a multiple of ``B`` saved by a node whose other tensors scale.
Parameters, their gradients and optimizer state, and tensors built from shapes alone (a ``T×T`` causal
mask, positions ``arange(T)``) do not scale. ``B`` is the most frequent first dimension of the activations'
shapes (pass ``batch_size=`` when the model is not batch-first everywhere and that guess is wrong).
"""

from __future__ import annotations

import difflib
from collections import Counter
from fnmatch import fnmatchcase
from math import prod

from gradscope._format import one_line
from gradscope._wrappers import user_name
from gradscope.errors import InputTypeError, InputValueError
from gradscope.graph import CALLED_MODULES, PARAMS
from gradscope.graph.attribution import seq_order
from gradscope.memory.planning.cost import FORWARD_VIEWS

__all__ = ["require_modules", "resolve", "all_regions", "module_regions", "region_inputs", "infer_batch", "Scaler"]


def require_modules(graph, what: str) -> list[str]:
    """The traced module names of ``graph``; an :class:`InputValueError` when it was not traced."""
    called = graph.graph.get(CALLED_MODULES)
    if called is None:
        called = sorted({d["module"] for _, d in graph.nodes(data=True) if d.get("kind") == "op" and d.get("module")})
        if not called:
            raise InputValueError(
                f"report.{what}() needs to know which module made each node: record the forward under "
                "`with gradscope.trace(model) as tr:` and call gradscope.inspect(loss, model=model, trace=tr)."
            )
    return list(called)


def _patterns(value, arg: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise InputTypeError(
        f"{arg}= takes module names or fnmatch patterns (a str or a list of str), "
        f"got {type(value).__name__} {value!r:.60}."
    )


def resolve(graph, value, arg: str, names: list[str]) -> list[str]:
    """Expand names / fnmatch patterns into the outermost matching module names (call order kept).

    Raises:
        InputValueError: a pattern matches no traced module (the message names close matches).
    """
    hits: list[str] = []
    for pat in _patterns(value, arg):
        pat = user_name(pat)  # "_orig_mod.blocks.*" names the user's "blocks.*"
        found = [n for n in names if n == pat or fnmatchcase(n, pat)]
        if not found:
            close = difflib.get_close_matches(pat, names, n=3, cutoff=0.5)
            hint = (
                f" Did you mean {', '.join(map(repr, close))}?"
                if close
                else (f" Traced modules start with: {', '.join(map(repr, names[:5]))}.")
            )
            raise InputValueError(f"{arg}={pat!r} matches no module the traced forward called.{hint}")
        hits.extend(n for n in found if n not in hits)
    return [n for n in hits if not any(n.startswith(o + ".") for o in hits if o != n)]


def all_regions(graph, order: list[str] | None = None) -> dict[str, list[list[str]]]:
    """``{module name: [op node ids of one call, ...]}`` for every module and enclosing module of the
    traced graph, in one pass over the forward order (NOTE [module calls from sequence numbers])."""
    order = seq_order(graph) if order is None else order
    nodes = graph.nodes
    runs: dict[str, list[list[str]]] = {}
    last: dict[str, int] = {}
    for i, nid in enumerate(order):
        mod = nodes[nid].get("module")
        if not mod:
            continue
        parts = mod.split(".")
        for j in range(1, len(parts) + 1):
            name = ".".join(parts[:j])
            if last.get(name) == i - 1:
                runs[name][-1].append(nid)
            else:
                runs.setdefault(name, []).append([nid])
            last[name] = i
    return runs


def module_regions(
    graph, names: list[str], order: list[str] | None = None, regions: dict | None = None
) -> list[tuple[str, list[str]]]:
    """``[(module name, op node ids of one call)]`` for every call of every named module (NOTE [module
    calls from sequence numbers]), in forward order; ``regions``: :func:`all_regions`, when at hand."""
    order = seq_order(graph) if order is None else order
    regions = all_regions(graph, order) if regions is None else regions
    out = [(name, run) for name in names for run in regions.get(name, ())]
    first = {nid: i for i, nid in enumerate(order)}
    out.sort(key=lambda r: first[r[1][0]])
    return out


def _param_storages(graph) -> set:
    return {p["storage"] for p in graph.graph.get(PARAMS, {}).values() if p.get("storage") is not None}


def infer_batch(graph) -> int | None:
    """The most frequent first dimension of the saved activations' shapes (NOTE [what scales with the batch])."""
    params = _param_storages(graph)
    count: Counter = Counter()
    for _, d in graph.nodes(data=True):
        for e in d.get("saved", ()):
            s = e.get("shape")
            if s and len(s) >= 2 and e.get("storage") not in params and not e.get("scalar"):
                count[s[0]] += 1
    return count.most_common(1)[0][0] if count else None


class Scaler:
    """Decides which tensors scale with the batch (NOTE [what scales with the batch]).

    Args:
        graph: ``report.graph``.
        batch_size: the batch size of the traced forward; inferred when None.
    """

    def __init__(self, graph, batch_size: int | None = None):
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise InputValueError(f"batch_size= must be a positive int, got {one_line(batch_size)}.")
        self.batch_size = batch_size or infer_batch(graph)
        self._shapes: set[tuple] = set()
        for _, d in graph.nodes(data=True):
            self._shapes.update(tuple(e["shape"]) for e in d.get("saved", ()) if e.get("shape") is not None)
            self._shapes.update(tuple(s) for s in (d.get("out_shapes") or ()) if s is not None)

    def scales(self, shape, flat_floor: int | None = None) -> bool:
        """True when a tensor of ``shape`` grows with the batch.

        ``flat_floor``: the numel of the largest batch-scaling tensor of the same node; a flat buffer at
        least that large whose size is a multiple of the batch (an RNN workspace) scales too.
        """
        b = self.batch_size
        if not b or not shape:
            return False
        first = shape[0]
        if first == b or (b > 1 and b in shape):
            return True
        if first % b == 0 and (b, first // b, *shape[1:]) in self._shapes:
            return True  # B·n×... : the view of a B×n×... tensor that the graph holds
        return len(shape) == 1 and flat_floor is not None and first % b == 0 and first >= flat_floor

    def flat_floor(self, data) -> int | None:
        """The numel of the largest batch-scaling saved tensor or output of the op node ``data`` (or None)."""
        shapes = [e.get("shape") for e in data.get("saved", ())] + list(data.get("out_shapes") or ())
        sizes = [prod(s) for s in shapes if s and len(s) > 1 and self.scales(s)]
        return max(sizes) if sizes else None


# forward input position -> the saved slot names that hold that input, for the common ops
_SLOT_OF_INPUT = (
    {"self", "input", "mat1", "batch1", "query", "input_", "x"},
    {"other", "mat2", "batch2", "key", "weight"},
    {"value", "bias"},
)


def region_inputs(graph, region: list[str]) -> tuple[set, list[tuple[str, int]]]:
    """What ``checkpoint`` keeps of one region: the storages of its tensor inputs.

    The inputs are the outputs of nodes outside the region that feed it (``u -> v`` edges); each is found
    among the saved slots of the region node that consumes it (through view-like ops, whose output is the
    same storage), by its shape and, for ops with several same-shaped inputs, the slot of that input
    position.

    Returns:
        ``(storage keys, unsaved)``: keys of the saved storages that are region inputs, and
        ``(node, output index)`` of inputs that no region node saved (the frame keeps them alive).
    """
    inside = set(region)
    nodes = graph.nodes
    pred = getattr(graph, "_pred", None) or graph.pred
    found: dict[tuple, set] = {}  # (producer, output index) -> saved storage keys of that tensor
    for v in region:
        for u, e in pred[v].items():
            if u in inside or nodes[u].get("kind") != "op":
                continue
            outs = nodes[u].get("out_shapes") or []
            k = e.get("output", 0) or 0
            shape = outs[k] if k < len(outs) else None
            got = found.setdefault((u, k), set())
            got.update(_find_saved(graph, inside, v, e.get("index", 0), shape))
            got.update(
                _key(u, i, s)
                for i, s in enumerate(nodes[u].get("saved") or ())  # relu/tanh keep it
                if str(s.get("slot", "")).startswith("result") and shape is not None and s.get("shape") == list(shape)
            )
    keys = set().union(*found.values()) if found else set()
    return keys, [t for t, f in found.items() if not f]


def _key(nid, i, e):
    return ("s", e["storage"]) if e.get("storage") is not None else ("e", nid, i)


def _find_saved(graph, inside, v, index, shape) -> set:
    nodes = graph.nodes
    todo = [(v, index, shape)]
    seen: set = set()
    found: set = set()
    while todo:
        n, idx, sh = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        d = nodes[n]
        if d.get("name") in FORWARD_VIEWS and not d.get("saved"):
            outs = d.get("out_shapes") or [None]
            for w, e in graph.succ[n].items():
                if w in inside:
                    todo.append((w, e.get("index", 0), outs[e.get("output", 0) or 0]))
            continue
        same = [
            (i, e)
            for i, e in enumerate(d.get("saved") or ())
            if sh is not None and e.get("shape") == list(sh) and not e.get("scalar")
        ]
        if len(same) > 1 and idx < len(_SLOT_OF_INPUT):
            named = [(i, e) for i, e in same if e.get("slot") in _SLOT_OF_INPUT[idx]]
            same = named or same
        found.update(_key(n, i, e) for i, e in same)
    return found
