"""The module calls of a traced forward, as plain data: who called whom, which class, which nodes.

NOTE [module calls]
``trace()``'s hooks number every module call in the order it began and know its parent call. A call of
a module that belongs to the model gets its qualified name; a call of anything else (a loss module, a
module built on the fly) is not kept, and its nodes belong to the nearest named call around it. Each
kept call is written to ``graph.graph["module_calls"]`` as ``[name, parent, class, first, end]``:
``name`` is ``None`` for the model itself, ``parent`` the index of the enclosing kept call (``-1``: none),
``class`` the module's class name, and ``[first, end)`` the sequence numbers of the autograd nodes it
created (its own and its sub-calls'). Calls that created no node are left out. Sequence numbers grow
with creation time and calls nest in time, so every call's nodes form one contiguous run of the
forward order, and two calls of the same module one after the other stay two calls (an ``LSTMCell``
unrolled 200 times is 200 calls, where module names alone would show one run). The drawing folds
repeated blocks along these calls (gradscope.views.repeats, NOTE [folding whole calls]).
"""

from __future__ import annotations

__all__ = ["BATCH_MAX", "note_batch", "annotate_batch", "live_modules", "call_names", "module_calls"]


def live_modules(model) -> dict:
    """``id(module) -> (qualified name, module)`` for every module of ``model`` (``{}`` without one)."""
    live: dict = {}
    if model is not None:
        for name, m in model.named_modules(remove_duplicate=False):
            live.setdefault(id(m), (name, m))
    return live


def _named(calls, refs, live) -> list[bool]:
    out = []
    for key, _parent in calls:
        entry = live.get(key)
        ref = refs.get(key)
        out.append(entry is not None and ref is not None and ref() is entry[1])
    return out


def call_names(calls, refs, live) -> dict[int, str | None]:
    """call index -> qualified name of the innermost named module of that call (-1 -> None)."""
    out: dict[int, str | None] = {-1: None}
    for index, named in enumerate(_named(calls, refs, live)):
        key, parent = calls[index]
        out[index] = (live[key][0] or None) if named else out[parent]  # the model itself: None
    return out


def module_calls(calls, refs, live, op_calls) -> list[list]:
    """The kept calls (NOTE [module calls]) from ``op_calls``: ``(seq, innermost call index)`` per op node."""
    named = _named(calls, refs, live)
    kept_of: dict[int, int] = {-1: -1}  # call index -> the nearest named call at or above it
    for index, (_key, parent) in enumerate(calls):
        kept_of[index] = index if named[index] else kept_of[parent]
    lo: dict[int, int] = {}
    hi: dict[int, int] = {}
    for seq, call in op_calls:
        c = kept_of.get(call, -1)
        while c != -1:  # the node belongs to this call and to every named call around it
            if c in lo and lo[c] <= seq < hi[c]:
                break  # its ancestors already cover seq too
            lo[c] = min(lo.get(c, seq), seq)
            hi[c] = max(hi.get(c, seq + 1), seq + 1)
            c = kept_of[calls[c][1]]
    order = sorted(lo)
    new = {old: i for i, old in enumerate(order)}
    out = []
    for old in order:
        key, parent = calls[old]
        up = kept_of[parent]
        out.append([live[key][0] or None, new.get(up, -1), type(live[key][1]).__name__, lo[old], hi[old]])
    return out


#: The most batch storages one trace records (NOTE [the traced batch]).
BATCH_MAX = 256


def note_batch(args, batch: dict, outermost: bool) -> None:
    """Add the batch among an outermost module call's ``args`` to ``batch`` (storage key -> record); a call
    inside another one (``outermost`` False) adds nothing.

    NOTE [the traced batch]
    The tensors an outermost module call is given that no op made (no grad_fn) and that need no gradient
    are the batch: alive before the forward and, held by the caller, through the step, whether or not an
    op saves them. Only plain data is kept, ``[storage key, bytes, shape, dtype]`` (no reference, not
    even a weak one: ``torch.utils.swap_tensors`` refuses a tensor that has one); ``Trace.annotate`` adds
    the storage id the walk gave it, and ``memory/replay/accounting.batch_bytes`` counts each storage
    once, and not at all when an op saved it (then it is among the activations).
    """
    if not outermost or len(batch) >= BATCH_MAX:
        return
    import torch

    from gradscope import _torch

    stack = list(args) if isinstance(args, (tuple, list)) else [args]
    while stack and len(batch) < BATCH_MAX:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.grad_fn is not None or v.requires_grad:
                continue
            try:
                ptr, nbytes = _torch.storage_key_and_bytes(v)
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            if ptr not in batch:
                batch[ptr] = [ptr, nbytes, list(v.shape), str(v.dtype).replace("torch.", "")]
        elif isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())


def annotate_batch(batch: dict, graph) -> None:
    """Write ``batch`` (:func:`note_batch`) into ``graph.graph[BATCH]``, each record with the storage id the
    walk gave that storage (an op saved it; below 0: an input leaf's), or None."""
    if batch:
        from gradscope.graph import BATCH

        ptrs = getattr(getattr(graph, "compact", None), "storage_ptrs", None) or {}
        graph.graph[BATCH] = [[*b, ptrs.get(b[0])] for b in batch.values()]
