"""Random forward programs over the vocabulary in ``_vocab``: representation, strategy, execution."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

from ._vocab import INPLACE, OPS, SLOW_ONLY, make_params

__all__ = ["Program", "programs", "programs_slow", "run_program", "Run"]

CONTEXTS = ("plain", "no_grad", "ckpt", "ckpt_reentrant")
ROOT_MODES = ("sum", "list", "nonscalar")


@dataclass(frozen=True)
class Program:
    """``steps``: (op, i, j, context); ``i``/``j`` pick pool entries modulo the pool size."""

    steps: tuple
    roots: tuple = (0,)
    mode: str = "sum"

    def source(self) -> str:
        """A readable listing, shown by hypothesis when a program falsifies a property."""
        lines = [f"{ctx:>14}  {op}(pool[{i}], pool[{j}])" for op, i, j, ctx in self.steps]
        lines.append(f"roots={list(self.roots)} mode={self.mode}")
        return "\n".join(lines)


_SKIP = os.environ.get("GRADSCOPE_FUZZ_SKIP", "").split(",")
_ALL_OPS = [o for o in list(OPS) + list(INPLACE) if o not in _SKIP]
_CTX = tuple(c for c in ("plain",) * 4 + CONTEXTS[1:] if c not in _SKIP)


def _programs(ops):
    step = st.tuples(st.sampled_from(ops), st.integers(0, 15), st.integers(0, 15), st.sampled_from(_CTX))
    return st.builds(Program, st.lists(step, min_size=1, max_size=10).map(tuple),
                     st.lists(st.integers(0, 15), min_size=1, max_size=3).map(tuple),
                     st.sampled_from(ROOT_MODES))


programs = _programs([o for o in _ALL_OPS if o not in SLOW_ONLY])
programs_slow = _programs(_ALL_OPS)


@dataclass
class Run:
    """Everything one execution produced; ``root`` is a tensor or a list of tensors."""

    params: dict
    inputs: list
    pool: list
    root: object
    ckpt_nodes: list      # grad_fn of each tensor passed to checkpoint(use_reentrant=False)


def _apply(fn, params, s, t, ctx, inplace):
    if ctx == "no_grad":
        with torch.no_grad():
            return fn(params, s, t)
    if ctx.startswith("ckpt") and not inplace:
        return checkpoint(lambda a, b: fn(params, a, b), s, t, use_reentrant=ctx == "ckpt_reentrant")
    return fn(params, s, t)


def _readable(t) -> bool:
    # torch forbids even reading grad_fn of a no_grad view whose base was modified in place with grad
    # enabled ("A view was created in no_grad mode ..."); such a tensor cannot be a root.
    try:
        _ = t.grad_fn
    except RuntimeError:
        return False
    return True


def run_program(prog: Program, seed: int = 0) -> Run:
    """Execute ``prog`` deterministically (same seed, same tensors and graph, every time)."""
    torch.manual_seed(seed)
    params = make_params()
    x = torch.randn(2, 4)
    m = torch.randn(2, 4, requires_grad=True)   # a leaf input that is not a parameter
    pool = [x, params["a"], m]
    ckpt_nodes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op, i, j, ctx in prog.steps:
            s, t = pool[i % len(pool)], pool[j % len(pool)]
            inplace = op in INPLACE
            fn = INPLACE[op] if inplace else OPS[op]
            if ctx == "ckpt" and not inplace:
                ckpt_nodes.extend(v.grad_fn for v in (s, t) if v.grad_fn is not None)
            try:
                out = _apply(fn, params, s, t, ctx, inplace)
            except RuntimeError:
                continue  # e.g. in-place on a leaf that requires grad: torch refuses before writing
            if not inplace:
                pool.append(out)
    picks = [p for p in (pool[k % len(pool)] for k in prog.roots) if _readable(p)] or [x]
    if prog.mode == "sum":
        root = picks[0].sum()
        for p in picks[1:]:
            root = root + p.sum()
    elif prog.mode == "list":
        root = [p.sum() for p in picks]
    else:
        root = picks[0]
    return Run(params, [x, m], pool, root, ckpt_nodes)
