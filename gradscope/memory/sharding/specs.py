"""``gradscope.DDP`` and ``gradscope.FSDP``: how a step is sharded, as plain data.

A spec describes the wrapping a user writes, with torch's own argument names: ``DistributedDataParallel(m,
gradient_as_bucket_view=..., bucket_cap_mb=...)`` and ``fully_shard(module, reshard_after_forward=...,
mp_policy=..., offload_policy=...)`` on each module of ``modules`` and then on the root. torch's
``MixedPrecisionPolicy`` and ``CPUOffloadPolicy`` are accepted as they are; only the fields the memory
depends on are read (``param_dtype``, ``reduce_dtype``, ``pin_memory``), so a spec never holds a tensor.

>>> DDP(8)
DDP(world_size=8, gradient_as_bucket_view=False, bucket_cap_mb=25)
>>> FSDP(8, reshard_after_forward=False).modules
('blocks.*',)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gradscope._format import one_line
from gradscope.errors import InputTypeError, InputValueError

__all__ = ["DDP", "FSDP", "Shard", "dtype_name", "dtype_bytes"]


def _world(world_size: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise InputTypeError(f"world_size takes the number of ranks (an int), got {world_size!r:.60}.")
    if world_size < 1:
        raise InputValueError(f"world_size must be at least 1, got {one_line(world_size)}.")


def dtype_name(dtype: object) -> str | None:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``; None stays None."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in _SIZES:
        raise InputValueError(f"{dtype!r} is not a floating dtype a mixed-precision policy can use.")
    return name


_SIZES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8, "double": 8}


@dataclass(frozen=True, slots=True)
class DDP:
    """``torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=..., bucket_cap_mb=...)``
    on ``world_size`` ranks, each running the traced batch.

    Args:
        world_size: the number of ranks.
        gradient_as_bucket_view: the ``.grad``s are views into the gradient buckets (no second copy).
        bucket_cap_mb: the bucket size in MB (changes how many buckets, not their total).
    """

    world_size: int
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float = 25

    def __post_init__(self) -> None:
        _world(self.world_size)
        if not isinstance(self.gradient_as_bucket_view, bool):
            raise InputTypeError(
                f"gradient_as_bucket_view takes True or False, got {self.gradient_as_bucket_view!r:.60}."
            )
        cap = self.bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
            raise InputValueError(f"bucket_cap_mb must be a positive number of MB, got {cap!r:.60}.")

    def label(self) -> str:
        return f"DDP({self.world_size}{', gradient_as_bucket_view=True' if self.gradient_as_bucket_view else ''})"

    def code(self, names: list[str] | None = None) -> str:
        """The line a user writes."""
        extra = ", gradient_as_bucket_view=True" if self.gradient_as_bucket_view else ""
        return f"model = DistributedDataParallel(model{extra})  # {self.world_size} ranks"


@dataclass(frozen=True, slots=True)
class FSDP:
    """``fully_shard(m, ...)`` on every module matching ``modules`` (qualified names or fnmatch patterns),
    then on the root, on ``world_size`` ranks each running the traced batch.

    Args:
        world_size: the number of ranks (the mesh's size).
        modules: the modules passed to ``fully_shard`` before the root (the root is always one).
        reshard_after_forward: True frees each module's unsharded parameters after its forward, False keeps
            them to backward, an int reshards to a mesh of that size (it divides ``world_size``). The root
            keeps its parameters (torch's default for the root).
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``).
        offload_policy: a ``torch.distributed.fsdp.CPUOffloadPolicy``: shards, gradients and optimizer state
            on the host.
    """

    world_size: int
    modules: tuple[str, ...] = ("blocks.*",)
    reshard_after_forward: bool | int = True
    mp_policy: Any = field(default=None, compare=False)  # torch's policies are not hashable: the fields
    offload_policy: Any = field(default=None, compare=False)  # below, read from them, are compared
    param_dtype: str | None = field(default=None, init=False, repr=False)
    reduce_dtype: str | None = field(default=None, init=False, repr=False)
    offload: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        _world(self.world_size)
        mods = (self.modules,) if isinstance(self.modules, str) else self.modules
        if not isinstance(mods, (list, tuple)) or not all(isinstance(m, str) for m in mods):
            raise InputTypeError(f"modules takes module names or patterns such as ['blocks.*'], got {mods!r:.60}.")
        object.__setattr__(self, "modules", tuple(mods))
        r = self.reshard_after_forward
        if not isinstance(r, (bool, int)):
            raise InputTypeError(f"reshard_after_forward takes True, False or an int, got {r!r:.60}.")
        if not isinstance(r, bool) and (r < 1 or self.world_size % r):
            raise InputValueError(
                f"reshard_after_forward={r} must be a divisor of world_size={self.world_size} (the size of the "
                "mesh parameters are resharded to after forward)."
            )
        mp = self.mp_policy
        if mp is not None:
            if not hasattr(mp, "param_dtype"):
                raise InputTypeError(f"mp_policy takes a torch.distributed.fsdp.MixedPrecisionPolicy, got {mp!r:.60}.")
            object.__setattr__(self, "param_dtype", dtype_name(mp.param_dtype))
            object.__setattr__(self, "reduce_dtype", dtype_name(getattr(mp, "reduce_dtype", None)))
        off = self.offload_policy
        if off is not None:
            if type(off).__name__ not in ("CPUOffloadPolicy", "OffloadPolicy"):
                raise InputTypeError(
                    f"offload_policy takes a torch.distributed.fsdp.CPUOffloadPolicy, got {off!r:.60}."
                )
            object.__setattr__(self, "offload", type(off).__name__ == "CPUOffloadPolicy")

    @property
    def reshard_size(self) -> int:
        """Ranks each unsharded parameter is spread over between forward and backward (``world_size`` when
        resharded, 1 when kept, the int otherwise)."""
        r = self.reshard_after_forward
        if r is True:
            return self.world_size
        if r is False:
            return 1
        return int(r)

    def label(self) -> str:
        """``FSDP(8, reshard_after_forward=False, bf16)``: the settings that differ from the defaults."""
        extra = (
            [f"reshard_after_forward={self.reshard_after_forward!r}"] if self.reshard_after_forward is not True else []
        )
        extra += [self.param_dtype] if self.param_dtype else []
        extra += ["CPU offload"] if self.offload else []
        return f"FSDP({', '.join([str(self.world_size), *extra])})"

    def code(self, names: list[str] | None = None) -> str:
        """The lines a user writes (``names``: the modules ``modules`` resolved to, when known)."""
        args = (
            [f"reshard_after_forward={self.reshard_after_forward!r}"] if self.reshard_after_forward is not True else []
        )
        if self.param_dtype:
            red = f", reduce_dtype=torch.{self.reduce_dtype}" if self.reduce_dtype else ""
            args.append(f"mp_policy=MixedPrecisionPolicy(param_dtype=torch.{self.param_dtype}{red})")
        if self.offload:
            args.append("offload_policy=CPUOffloadPolicy()")
        a = "".join(", " + x for x in args)
        root = "".join(", " + x for x in args if not x.startswith("reshard_after_forward"))
        if names is None:  # the outermost matching modules, as the prediction reads ``modules``
            pats = ", ".join(repr(m) for m in self.modules)
            pick = (
                f"names = [n for n, _ in model.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in [{pats}])]\n"
                "names = [n for n in names if not any(n.startswith(o + '.') for o in names)]\n"
            )
        else:
            pick = f"names = {names!r}\n"
        return (
            f"mesh = init_device_mesh(device, ({self.world_size},))\n{pick}"
            f"for name in names:\n"
            f"    fully_shard(model.get_submodule(name), mesh=mesh{a})\n"
            f"fully_shard(model, mesh=mesh{root})"
        )


Shard = DDP | FSDP


def dtype_bytes(name: str | None, default: int) -> int:
    return _SIZES[name] if name else default
