"""What a device target is: the questions the replay and :func:`gradscope.memory.kernels_on_meta` ask a device.

NOTE [device targets]
The replay counts bytes the way the graph shows them: one storage of ``nbytes`` is ``nbytes``. A device turns
that into its own memory by rules of its allocator (CPU's c10 allocator counts what was asked; CUDA's caching
allocator rounds each block up, NOTE [CUDA caching allocator]) and picks its own kernels, which save different
tensors (``F.scaled_dot_product_attention``: flash on CPU without dropout, math with it; flash or
memory-efficient on CUDA). A :class:`Target` answers both questions; ``Overrides.target`` hands it to the
replay, ``kernels_on_meta(target)`` makes a forward on ``meta`` tensors take the target's kernels. A target
whose numbers were not checked on its device says so (:attr:`Target.note`), and every printed prediction
made for it repeats that.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Target", "MATH", "FLASH", "EFFICIENT"]

#: Attention kernels a target may pick for ``F.scaled_dot_product_attention`` (torch's ``SDPBackend`` names).
MATH, FLASH, EFFICIENT = "math", "flash", "efficient"


class Target:
    """A device the prediction is for. Subclasses: :class:`~gradscope.memory.targets.cpu.CPU`,
    :class:`~gradscope.memory.targets.cuda.CUDA`."""

    #: ``"cpu"``, ``"cuda"``: the device type the step runs on.
    name: str = ""
    #: True when this target's numbers were checked against the device's own measurement (the tests do it
    #: for CPU against torch.profiler); False: the rules are modelled from torch's source, not measured.
    measured: bool = True
    #: Whether ``torch.optim`` picks its foreach implementation by default on this device.
    foreach: bool = False
    #: What every prediction for this target says about how far to trust it ("" when measured).
    note: str = ""
    #: What the target does not model, in words (printed with the prediction).
    unmodelled: tuple[str, ...] = ()

    def allocated(self, nbytes: int) -> int:
        """Bytes the device's allocated-memory count grows by for one storage of ``nbytes`` bytes."""
        return int(nbytes)

    def reserved(self, blocks: Iterable[int]) -> int:
        """An estimate of the memory the allocator holds from the device for live storages of ``blocks``
        bytes each (CPU: what they allocate)."""
        return sum(self.allocated(b) for b in blocks)

    def sdpa_backend(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ) -> str:
        """The kernel this device runs for ``F.scaled_dot_product_attention`` with these arguments
        (:data:`MATH`, :data:`FLASH` or :data:`EFFICIENT`), read from their metadata only."""
        return MATH

    def fixed_parts(self, names: Iterable[str]) -> dict:
        """Memory the device holds for the step besides tensors (a library's workspace), by name, given the
        node names of the graph."""
        return {}

    @property
    def label(self) -> str:
        """The device in the printed views: its name, with "(modelled, not measured on a GPU)" when so."""
        return self.name if self.measured else f"{self.name} (modelled, not measured on a GPU)"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
