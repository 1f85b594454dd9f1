"""Model wrappers: DDP / DataParallel and ``torch.compile``'s wrapper unwrapped, FSDP2 recognized."""

from __future__ import annotations

import torch

__all__ = ["PARALLEL_WRAPPERS", "unwrap_parallel", "unwrap_compiled", "is_fsdp2"]

#: Wrappers whose ``.module`` is the model the user wrote: its parameter names carry no ``module.`` prefix.
PARALLEL_WRAPPERS = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)


def unwrap_parallel(model):
    """The model inside a DistributedDataParallel / DataParallel wrapper, or ``model`` itself."""
    return model.module if isinstance(model, PARALLEL_WRAPPERS) else model


def unwrap_compiled(model):
    """The module ``torch.compile(module)`` wrapped (its parameters carry no ``_orig_mod.`` prefix), or
    ``model`` itself; read by name so that ``torch._dynamo`` is never imported here."""
    inner = getattr(model, "_orig_mod", None) if type(model).__name__ == "OptimizedModule" else None
    return inner if isinstance(inner, torch.nn.Module) else model


def is_fsdp2(module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` (``torch.distributed.fsdp.FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(module, FSDPModule)
