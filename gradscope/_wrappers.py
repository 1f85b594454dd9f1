"""Model wrappers: DDP / DataParallel and ``torch.compile``'s wrapper unwrapped, FSDP2 recognized."""

from __future__ import annotations

import torch

__all__ = ["PARALLEL_WRAPPERS", "unwrap_parallel", "unwrap_compiled", "unwrap", "user_name", "is_fsdp2"]

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


def unwrap(model):
    """The model the user wrote, inside any nesting of ``torch.compile`` and DDP / DataParallel wrappers
    (``torch.compile(DDP(m))``, ``DDP(torch.compile(m))``): its parameter names are the user's."""
    for _ in range(8):  # wrappers nest a few levels at most
        inner = unwrap_parallel(unwrap_compiled(model))
        if inner is model:
            return model
        model = inner
    return model


#: The name segments a wrapper adds in front of the user's parameter names.
_WRAPPER_SEGMENTS = ("_orig_mod.",)


def user_name(name: str) -> str:
    """``name`` without the ``_orig_mod.`` segments ``torch.compile`` puts in front of the user's names
    (``"_orig_mod.a.weight"`` -> ``"a.weight"``), so both spellings name the same parameter."""
    while name.startswith(_WRAPPER_SEGMENTS):
        for seg in _WRAPPER_SEGMENTS:
            if name.startswith(seg):
                name = name[len(seg) :]
    return name


def is_fsdp2(module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` (``torch.distributed.fsdp.FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(module, FSDPModule)
