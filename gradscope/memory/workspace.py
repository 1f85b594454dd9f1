"""Kernel workspace: memory a backward kernel allocates and frees inside one node (no graph shows it)."""

from __future__ import annotations

__all__ = ["node_workspace"]


def node_workspace(prog, v: int, grad_scale=None) -> int:
    return 0
