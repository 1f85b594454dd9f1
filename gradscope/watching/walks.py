"""Bounded walks over a live autograd graph for the cross-step checks (read-only; nothing is kept)."""

from __future__ import annotations

from bisect import bisect_right

import torch

from gradscope._torch import sequence_nr, storage_key_and_bytes
from gradscope.walk.saved import node_type
from gradscope.walk.traverse import traverse

__all__ = ["graph_stats", "graph_nodes"]

_WALK_LIMIT = 50_000


def _walk(starts, param_ids, param_storages, select, through, limit=_WALK_LIMIT):
    """Walk the graph from ``starts`` (nodes). ``select(seq)`` gives a key for a node to count, or None:
    such a node is walked through when ``through`` and left out otherwise. Returns (nodes counted, live
    saved bytes in them, parameters excluded; whether a counted node's saved tensors were freed; the
    watched parameters reached; the keys counted)."""
    skip = set(param_storages)
    nodes = held = 0
    freed = False
    reached: set[str] = set()
    keys: set = set()

    def visit(n) -> bool:
        nonlocal nodes, held, freed
        info = node_type(n)
        if info.leaf:
            name = param_ids.get(id(getattr(n, "variable", None)))
            if name is not None:
                reached.add(name)
            return False
        key = select(sequence_nr(n))
        if key is None:
            return through
        keys.add(key)
        nodes += 1
        if info.custom:
            try:
                saved = n.saved_tensors
            except RuntimeError:
                freed, saved = True, ()
            for t in saved:
                held += _bytes(t, skip)
        for _slot, raw_attr, attr in info.tensor_slots:
            try:
                raw = getattr(n, raw_attr, None)
            except RuntimeError:  # a tuple of saved tensors (index_put's indices) refuses to be read once freed
                freed = True
                continue
            if isinstance(raw, (tuple, list)):  # a list slot (index_put's indices): each one's tensor
                for r in raw:
                    d = getattr(r, "data", None)
                    if isinstance(d, torch.Tensor):
                        held += _bytes(d, skip)
                continue
            data = None if raw is None else raw.data
            if isinstance(data, torch.Tensor):
                held += _bytes(data, skip)
            elif data is None and raw is not None:
                try:
                    getattr(n, attr)
                except RuntimeError:
                    freed = True
        return True

    traverse(starts, visit, limit)
    return nodes, held, freed, reached, keys


def _bytes(t, skip) -> int:
    try:
        ptr, size = storage_key_and_bytes(t)
    except (RuntimeError, NotImplementedError, TypeError):
        return 0
    if ptr in skip:
        return 0
    skip.add(ptr)
    return size


def graph_stats(starts, param_ids, param_storages=(), *, below=None, at_least=None):
    """Nodes, live saved bytes, freed?, parameters reached, for the nodes older than ``below`` or at least
    ``at_least`` (sequence numbers) reachable from ``starts``."""

    def select(seq):
        return None if (below is not None and seq >= below) or (at_least is not None and seq < at_least) else 0

    return _walk(starts, param_ids, param_storages, select, through=False)[:4]


def graph_nodes(starts, ranges, param_ids, param_storages, limit):
    """How many of the forwards ``ranges`` (sorted ``[(seq0, seq1)]``) the graph from ``starts`` reaches,
    with their node count and saved bytes; nodes outside every range are walked through."""
    lows = [r[0] for r in ranges]

    def select(seq):
        i = bisect_right(lows, seq) - 1
        return i if i >= 0 and seq < ranges[i][1] else None

    nodes, held, _, _, keys = _walk(starts, param_ids, param_storages, select, through=True, limit=limit)
    return len(keys), nodes, held
