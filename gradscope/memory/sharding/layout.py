"""Which parameters each rank holds under FSDP2: the ``fully_shard`` groups and dim-0 shards.

NOTE [FSDP2 layout]
``fully_shard(module)`` makes one parameter group of the module's parameters that no inner ``fully_shard``
module took; the root takes the rest. Each parameter's dim 0 is chunked over the ranks as ``torch.chunk``
does (``ceil(d0 / world)`` rows per rank, the last ranks fewer or none); the shard's storage is padded to
chunk 0's size on every rank, while the optimizer state follows the unpadded local rows; each ``.grad`` is a
view of the unpadded rows into the group's flat reduce-scatter output, one padded shard of the group. The
all-gather and reduce-scatter buffers are flat: ``world`` times the padded shards of the group.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from gradscope.errors import InputValueError
from gradscope.graph import PARAMS
from gradscope.memory.replay.engine import numel_bytes

__all__ = ["Group", "groups", "group_of", "shard_rows"]

ROOT = ""


@dataclass
class Group:
    """One ``fully_shard`` parameter group (``name`` ``""`` is the root)."""

    name: str
    params: list[str] = field(default_factory=list)
    full: int = 0  # unsharded bytes (in the parameters' dtype)
    padded: int = 0  # one rank's padded shard bytes
    local: list[int] = field(default_factory=list)  # per rank: unpadded shard bytes
    numel_padded: int = 0  # one rank's padded shard elements (the flat buffers' unit)
    numel_full: int = 0
    sizes: dict[str, int] = field(default_factory=dict)  # parameter -> unsharded bytes

    def bytes_of(self, param: str) -> int:
        return self.sizes.get(param, 0)


def shard_rows(d0: int, world: int, rank: int) -> int:
    """Rows of dim 0 rank ``rank`` holds (``torch.chunk``: ``ceil(d0 / world)`` each, the last ranks fewer)."""
    chunk = -(-d0 // world) if d0 else 0
    return max(0, min(chunk, d0 - rank * chunk))


def _outermost(names: list[str], patterns) -> list[str]:
    hit = [n for n in names if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    return [n for n in hit if not any(n.startswith(o + ".") for o in hit if o != n)]


def group_of(name: str, prefixes: list[str]) -> str:
    """The group of a module or parameter name: the longest group prefix it falls under, else the root."""
    best = ROOT
    for p in prefixes:
        if (name == p or name.startswith(p + ".")) and len(p) > len(best):
            best = p
    return best


def groups(graph, modules: list[str], patterns, world: int) -> list[Group]:
    """The root group then one group per outermost module matching ``patterns``, in ``modules``' order."""
    chosen = _outermost(modules, patterns)
    if not chosen:
        raise InputValueError(
            f"FSDP(modules={list(patterns)!r}) matches no module of the traced model; name the blocks passed "
            "to fully_shard (e.g. 'layers.*', 'model.layers.*')."
        )
    out = {ROOT: Group(ROOT, local=[0] * world)}
    for n in chosen:
        out[n] = Group(n, local=[0] * world)
    for pname, p in graph.graph.get(PARAMS, {}).items():
        g = out[group_of(pname.rsplit(".", 1)[0] if "." in pname else "", chosen)]
        shape = list(p.get("shape") or [])
        dtype = p.get("dtype") or "float32"
        full = numel_bytes(shape, dtype)
        numel = 1
        for s in shape:
            numel *= int(s)
        d0 = int(shape[0]) if shape else 1
        rest = numel // d0 if d0 else 0
        g.params.append(pname)
        g.sizes[pname] = full
        g.full += full
        g.numel_full += numel
        chunk = -(-d0 // world) if d0 else 0
        g.numel_padded += chunk * rest
        g.padded += numel_bytes([chunk * rest], dtype)
        for r in range(world):
            g.local[r] += numel_bytes([shard_rows(d0, world, r) * rest], dtype)
    return list(out.values())
