"""The words and code of a plan: budgets parsed, module spans shortened, the lines to add."""

from __future__ import annotations

import re

from gradscope._format import human_bytes
from gradscope.errors import InputTypeError, InputValueError

__all__ = ["parse_budget", "budget_note", "span_names", "plan_code"]

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
        raise InputTypeError(f"budget= takes a size such as '12GiB' or a number of bytes, got {budget!r:.60}.")
    if isinstance(budget, str):
        m = _SIZE.match(budget)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise InputValueError(f"budget={budget!r} is not a size: write it like '12GiB', '16 GB' or '512MiB'.")
        budget = float(m.group(1)) * _UNITS[unit]
    if not budget > 0:
        raise InputValueError(f"budget= must be positive, got {budget!r}.")
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


def span_names(names: list[str]) -> str:
    """``['blocks.4', ..., 'blocks.11'] -> 'blocks.4-11'`` (consecutive numbered siblings joined)."""
    out: list[str] = []
    run: list[tuple[str, int]] = []

    def flush():
        if len(run) > 2:
            out.append(f"{run[0][0]}.{run[0][1]}-{run[-1][1]}")
        else:
            out.extend(f"{p}.{i}" for p, i in run)
        run.clear()

    for n in names:
        head, _, tail = n.rpartition(".")
        if head and tail.isdigit() and run and run[-1][0] == head and run[-1][1] + 1 == int(tail):
            run.append((head, int(tail)))
            continue
        flush()
        if head and tail.isdigit():
            run.append((head, int(tail)))
        else:
            out.append(n)
    flush()
    return ", ".join(out)


def plan_code(checkpoint: list[str], offload: list[str], model: str = "model") -> str:
    """The lines to add after building ``model``: the plan applied with torch's own APIs."""
    lines = []
    if checkpoint:
        lines += [
            "from functools import partial",
            "from torch.utils.checkpoint import checkpoint",
            "",
            f"for name in {checkpoint!r}:",
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
            f"for name in {offload!r}:",
            f"    module = {model}.get_submodule(name)",
            "    module.forward = offloaded(module.forward)",
        ]
    return "\n".join(lines)
