"""The words and code of a plan: budgets parsed, module spans shortened, the lines to add."""

from __future__ import annotations

import re

from gradscope._format import human_bytes, one_line
from gradscope.errors import InputTypeError, InputValueError

__all__ = ["parse_budget", "budget_note", "span_names", "plan_code", "floor_bytes", "not_fit"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_budget(budget) -> int:
    """``"12GiB"``, ``"16 GB"``, ``"512MiB"`` or an int of bytes -> bytes (GB = 10^9, GiB = 2^30)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise InputTypeError(f"budget= takes a size such as '12GiB' or a number of bytes, got {one_line(budget)}.")
    if isinstance(budget, str):
        m = _SIZE.match(budget)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise InputValueError(f"budget={budget!r} is not a size: write it like '12GiB', '16 GB' or '512MiB'.")
        budget = float(m.group(1)) * _UNITS[unit]
    if not budget > 0:
        raise InputValueError(f"budget= must be positive, got {one_line(budget)}.")
    return int(budget)


def budget_note(budget) -> str | None:
    """For a budget written in decimal units (``"16GB"``), the sentence that says how it was read
    (``budget 16GB read as 16,000,000,000 bytes = 14.9 GiB ...``); None for binary units and plain bytes."""
    m = _SIZE.match(budget) if isinstance(budget, str) else None
    unit = m.group(2).lower() if m else ""
    if m is None or unit in ("", "b") or unit.endswith("ib") or unit not in _UNITS:
        return None
    n = parse_budget(budget)
    k = "kmgt".index(unit[0]) + 1
    dec, binary = unit[0].upper() + "B", unit[0].upper() + "iB"
    return (
        f"budget {budget.strip()} read as {n:,} bytes = {human_bytes(n)} (1 {dec} = 10^{3 * k} bytes; "
        f"write {m.group(1)}{binary} for units of 2^{10 * k})."
    )


_NUMBERED = re.compile(r"^(?P<head>.*?)\.(?P<i>\d+)(?P<tail>(?:\.[^.\d][^.]*)*)$")


def _runs(names: list[str]) -> list:
    """``names`` as items: a name, or ``(head, first, last, tail)`` for 3+ consecutive numbered siblings
    (``blocks.4`` ... ``blocks.11`` or ``h.0.mlp`` ... ``h.2.mlp``, the last number counting)."""
    out: list = []
    for n in names:
        m = _NUMBERED.match(n)
        if m is None:
            out.append(n)
            continue
        head, i, tail = m["head"], int(m["i"]), m["tail"]
        last = out[-1] if out else None
        if isinstance(last, list) and last[0] == head and last[3] == tail and last[2] + 1 == i:
            last[2] = i
        else:
            out.append([head, i, i, tail])
    items: list = []
    for it in out:
        if isinstance(it, list) and it[2] - it[1] >= 2:
            items.append(tuple(it))
        elif isinstance(it, list):
            items += [f"{it[0]}.{j}{it[3]}" for j in range(it[1], it[2] + 1)]
        else:
            items.append(it)
    return items


def span_names(names: list[str]) -> str:
    """``['blocks.4', ..., 'blocks.11'] -> 'blocks[4:12]'`` (3+ consecutive numbered siblings as a slice)."""
    return ", ".join(it if isinstance(it, str) else f"{it[0]}[{it[1]}:{it[2] + 1}]{it[3]}" for it in _runs(names))


def _names_expr(names: list[str]) -> str:
    """Python for the list ``names``: a range comprehension for a contiguous run, else the list itself."""
    items = _runs(names)
    if len(items) == 1 and not isinstance(items[0], str):
        head, a, b, tail = items[0]
        return f'[f"{head}.{{i}}{tail}" for i in range({a}, {b + 1})]'
    return repr(names)


def plan_code(checkpoint: list[str], offload: list[str], model: str = "model") -> str:
    """The lines to add after building ``model``: the plan applied with torch's own APIs."""
    lines = []
    if checkpoint:
        lines += [
            "from functools import partial",
            "from torch.utils.checkpoint import checkpoint",
            "",
            f"for name in {_names_expr(checkpoint)}:",
            f"    module = {model}.get_submodule(name)",
            "    module.forward = partial(checkpoint, module.forward, use_reentrant=False)",
        ]
    if offload:
        lines += ([""] if lines else []) + [
            "import torch",
            "",
            "def offloaded(forward):",
            "    def run(*args, **kwargs):",
            "        with torch.autograd.graph.save_on_cpu(pin_memory=True):",
            "            return forward(*args, **kwargs)",
            "    return run",
            "",
            f"for name in {_names_expr(offload)}:",
            f"    module = {model}.get_submodule(name)",
            "    module.forward = offloaded(module.forward)",
        ]
    return "\n".join(lines)


def floor_bytes(report, base) -> int:
    """Bytes no plan removes (``base``: the unchanged step's WhatIf): parameters, buffers, every
    gradient, optimizer state (as a later step starts with it) and step temporaries."""
    from gradscope.graph import PARAMS
    from gradscope.memory.replay.engine import numel_bytes

    parts = base.memory.later_step.parts
    params = report.graph.graph.get(PARAMS, {})
    grads = sum(numel_bytes(p.get("shape"), p.get("dtype")) for p in params.values() if p.get("requires_grad"))
    step = base.memory.step
    return (
        parts.get("parameters", 0)
        + parts.get("buffers", 0)
        + grads
        + parts.get("optimizer state", 0)
        + (max(0, step.peak) if step is not None else 0)
    )


def not_fit(best, limit: int, floor: int, tried: bool) -> str:
    b = human_bytes
    if floor > limit:
        return (
            f"Nothing fits: parameters, buffers, gradients and optimizer state alone take {b(floor)}, over "
            f"the {b(limit)} budget before any activation. Needed: at least {b(floor - limit)} more, or less "
            "state (a smaller model, lower precision, an optimizer with less state, or sharding)."
        )
    return (
        f"No plan fits: the best found{' (checkpointing every module that helps)' if tried else ''} peaks at "
        f"{b(best.peak)}, {b(best.peak - limit)} over the budget. A smaller batch may fit "
        "(report.max_batch(budget=...)), or a budget of at least " + b(best.peak) + "."
    )
