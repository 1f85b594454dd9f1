"""Ground truth from torch itself, shared by the tests."""

from __future__ import annotations

import torch

import gradscope


def none_grads(model: torch.nn.Module) -> set[str]:
    """Names of trainable parameters whose .grad is None (call after backward)."""
    return {n for n, p in model.named_parameters() if p.requires_grad and p.grad is None}


def flagged(report: gradscope.Report, severity: str = "error") -> set[str]:
    """Parameters gradscope predicts will get no gradient."""
    return {p for f in report.findings if f.kind in ("unused-parameter", "detached-branch")
            and f.severity == severity for p in f.params}


def kinds(report: gradscope.Report) -> list[str]:
    return [f.kind for f in report.findings]


def backward_raises_inplace(loss: torch.Tensor) -> bool:
    try:
        loss.backward()
    except RuntimeError as exc:
        if "modified by an inplace operation" in str(exc):
            return True
        raise
    return False


def hooked_unique_bytes(fn) -> int:
    """Run ``fn()`` under saved_tensors_hooks; total bytes of the unique storages packed."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen.setdefault(st._cdata, st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out
