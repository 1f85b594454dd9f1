"""Which of the user's Python variables keep autograd graphs of earlier forwards alive.

Looked for only when a check has already found such graphs: the local and global variables of the first
frames outside torch and gradscope (the training loop that called ``backward()`` or ``remove()``), one
level into lists, tuples and dicts (``losses.append(loss)``, ``metrics["loss"].append(loss)``). A variable
holds a forward's graph when its ``grad_fn`` graph reaches a node created in that forward (sequence
numbers, NOTE [step boundary] in :mod:`gradscope.watching.graphs`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gradscope._format import human_bytes
from gradscope._frames import frame_location, is_user_file
from gradscope._frames import user_caller as user_frame
from gradscope.watching.walks import graph_nodes

__all__ = ["user_frame", "frame_location", "find_holders", "holder_text", "Holder"]

_FRAMES = 3
_ITEMS = 10_000
_NODES = 200_000


class Holder(NamedTuple):
    name: str  # "the local variable 'total_loss' of train()"
    location: str  # file:line of that frame's current line
    forwards: int  # forwards (of the given ranges) whose graph it reaches
    nodes: int  # autograd nodes of those forwards
    bytes: int  # saved-tensor bytes in those nodes (parameters excluded)


def _candidates(value, label, out, depth=2):
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            out.append((label, [value]))
        return
    if depth == 0 or not isinstance(value, (list, tuple, dict)) or isinstance(value, str):
        return
    items = list(value.values() if isinstance(value, dict) else value)[:_ITEMS]
    keys = list(value.keys())[:_ITEMS] if isinstance(value, dict) else None
    tensors = [v for v in items if isinstance(v, torch.Tensor) and v.grad_fn is not None]
    if tensors:
        kind = "dict" if keys is not None else type(value).__name__
        out.append((f"the {kind} {label}", tensors))
    for i, v in enumerate(items):
        if not isinstance(v, torch.Tensor):
            _candidates(v, f"{label}[{keys[i]!r}]" if keys is not None else f"{label}[{i}]", out, depth - 1)


def find_holders(ranges, param_ids, param_storages=frozenset()):
    """The user's variables whose graphs reach nodes created in ``ranges`` (``[(seq0, seq1)]``), and the
    union of what they hold: ``(holders, (forwards, nodes, bytes))``."""
    ranges = sorted(ranges)
    frame = user_frame(2)
    found: list[Holder] = []
    seen_values: set[int] = set()
    every: list[torch.autograd.graph.Node | None] = []
    for _ in range(_FRAMES):
        if frame is None:
            break
        location = frame_location(frame)
        filename = location.rpartition(":")[0]
        where = (
            f"{frame.f_code.co_name}() in {filename}"
            if frame.f_code.co_name != "<module>"
            else f"the script {filename}"
        )
        scopes = [("local", frame.f_locals)]
        if frame.f_globals is not frame.f_locals:
            scopes.append(("global", frame.f_globals))
        for scope, names in scopes:
            for var, value in list(names.items()):
                if id(value) in seen_values or var.startswith("__"):
                    continue
                cands: list = []
                _candidates(value, repr(var), cands)
                for label, tensors in cands:
                    seen_values.add(id(value))
                    forwards, nodes, held = graph_nodes(
                        [t.grad_fn for t in tensors], ranges, param_ids, param_storages, _NODES
                    )
                    if forwards:
                        every.extend(t.grad_fn for t in tensors)
                        text = (
                            f"the {scope} variable {label} of {where}"
                            if not label.startswith("the ")
                            else f"{label} (a {scope} variable of {where})"
                        )
                        found.append(Holder(text, location, forwards, nodes, held))
        frame = frame.f_back
        while frame is not None and not is_user_file(frame.f_code.co_filename):
            frame = frame.f_back
    del frame
    found.sort(key=lambda h: (-h.forwards, h.name))
    total = graph_nodes(every, ranges, param_ids, param_storages, _NODES) if every else (0, 0, 0)
    return found, total


def holder_text(holders) -> str:
    parts = [
        f"{h.name} ({h.forwards} forward{'s' if h.forwards != 1 else ''}, {human_bytes(h.bytes)})" for h in holders[:3]
    ]
    return "; ".join(parts) + (f"; and {len(holders) - 3} more" if len(holders) > 3 else "")
