"""Checkpoint regions for the replay: recorded ones (from the walk) and requested ones (what-if)."""

from __future__ import annotations

__all__ = ["checkpoint_overrides"]


def checkpoint_overrides(prog, regions, sizes):
    raise NotImplementedError
