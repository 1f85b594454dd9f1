"""The answer of ``report.backward_memory()``: :class:`BackwardMemory`, its deferred fields and its views.

``memory/replay/backward.py`` makes it (the replay driver); ``memory/replay/views.py`` draws it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gradscope.errors import InputValueError

if TYPE_CHECKING:
    from gradscope.memory.replay.optimizer import StepBudget
    from gradscope.memory.replay.steady import StepPeak

__all__ = ["BackwardMemory"]


@dataclass
class BackwardMemory:
    """The replay's result. Levels are bytes relative to the moment backward starts.

    Attributes:
        order: node ids in the order autograd's engine will run them.
        levels: bytes allocated by backward and not yet freed after each node of ``order``.
        peak: the highest level during backward, workspace included.
        peak_node: the node id where the peak happens.
        end: the level after backward.
        base: bytes alive when backward starts (see :func:`replay`).
        absolute_peak: the higher of ``first_step.absolute_peak`` and ``later_step.absolute_peak``: the
            most memory a training loop of this step needs (replay/steady.py NOTE [first and later steps]).
        first_step: the step as inspected (its ``.grad`` and optimizer state): ``base`` plus the highest
            level up to the end of backward, or of ``optimizer.step()`` when an optimizer was given
            (:class:`~gradscope.memory.replay.steady.StepPeak`).
        later_step: every step after it: the optimizer's state from the start, ``.grad`` as ``zero_grad()``
            leaves it, ``accumulate`` micro-steps.
        uncounted: what may be alive when backward starts and is not in ``base`` (sentences; the batch of
            a forward neither traced nor given as ``inputs=``, where no op saved it): when not empty, the
            absolute peaks are lower bounds.
        step: the optimizer step's budget, or None.
        modules: module name per node of ``order`` (None when unknown).
        inner: the highest level inside each node (workspace included).
        workspace: kernel workspace per node id (only nodes that have some).
        unmodelled: reentrant checkpoint nodes whose recompute and nested backward are not replayed (the
            region has its own ``forward``: NOTE [reentrant checkpoint backward]); when not empty, ``peak``
            and ``absolute_peak`` are lower bounds. ``unmodelled_why``: for the traced ones, why the
            recording could not be used (memory/replay/traced.py NOTE [traced reentrant regions]). Nodes
            whose in-node memory is not known are listed too (``innode_unknown``: node id -> why).
        innode_unknown: node id -> why its in-node memory (kernel workspace, a formula's temporaries) is
            neither measured nor modelled (memory/kernels/workspace.py NOTE [in-node memory]).
        custom_runs: node id -> how a custom autograd.Function's backward was run to measure its in-node
            memory: ``"fake tensors"`` (the default: no data, no memory; memory/kernels/fake.py NOTE [custom
            backwards on fake tensors]) or ``"real random tensors (run_custom=True)"``; a custom node not
            listed here is in ``innode_unknown``, with the reason.
        notes: sentences on how the numbers were obtained (extrapolated sizes, a running profiler).
        target: the device target (``"cpu"`` unless ``target=`` said otherwise); a target not measured on
            its device makes every printed view say "modelled, not measured".
    """

    order: list
    levels: list
    peak: int
    peak_node: str | None
    end: int
    base: int
    absolute_peak: int
    if TYPE_CHECKING:  # deferred (NOTE [deferred fields]), always set
        first_step: StepPeak
        later_step: StepPeak
        uncounted: list[str]
    step: StepBudget | None = None
    modules: Sequence = field(default_factory=list)  # a list (computed on first use)
    inner: list = field(default_factory=list)
    workspace: dict = field(default_factory=dict)
    names: list = field(default_factory=list)
    locations: dict = field(default_factory=dict)
    parts: dict = field(default_factory=dict)
    unmodelled: list = field(default_factory=list)
    unmodelled_why: dict = field(default_factory=dict)  # node id -> why a traced region was not replayed
    innode_unknown: dict = field(default_factory=dict)  # node id -> why its in-node memory is not known
    notes: list = field(default_factory=list)  # sentences about how the numbers were obtained
    custom_runs: dict = field(default_factory=dict)  # node id -> how a custom backward was run to measure it
    target: Any = None  # the device target it was predicted for (gradscope.memory.targets; None: the CPU)
    # the rows, or a function computing them on first use
    _contributors: list[tuple[str, str, int]] | Callable[[], list[tuple[str, str, int]]] | None = field(
        default=None, repr=False, compare=False
    )
    _report: Callable[[], Any] | None = field(default=None, repr=False, compare=False)  # weakref to the report

    @classmethod
    def _deferred(cls, make: Callable[[], dict], **fields) -> BackwardMemory:
        """An instance with ``fields`` set and the fields ``make()`` returns filled on first access (NOTE
        [deferred fields])."""
        self = object.__new__(cls)
        self.__dict__.update(fields)
        self.__dict__["_make"] = make
        return self

    def __getattr__(self, name: str):
        make = self.__dict__.get("_make")  # only called for an attribute not set: a deferred field
        if make is None or name not in _DEFERRED:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self.__dict__["_make"] = None
        self.__dict__.update(make())
        return self.__dict__[name]

    def contributors(self) -> list[tuple[str, str, int]]:
        """What backward made that is alive at its peak, by module: ``(module, kind, bytes)`` rows, largest
        first (kind: ``gradients``, ``recomputed activations``, ``workspace``, ``reentrant recompute``: a
        reentrant checkpoint's recomputed activations and nested gradients at their highest), then the saved
        tensors freed before the peak as a negative row: the rows sum to ``peak``."""
        if self._contributors is None:
            return []
        got = self._contributors
        if callable(got):
            got = self._contributors = got()
        return got

    def reserved(self) -> int:
        """An estimate of the memory the device's allocator holds at backward's peak (CUDA: the caching
        allocator's segments behind the live blocks, without fragmentation: a lower bound of
        ``torch.cuda.memory_reserved()``; CPU: the live bytes)."""
        make = getattr(self, "_reserved", None)
        return int(make()) if callable(make) else self.absolute_peak

    @property
    def peak_module(self) -> str | None:
        """The module of the peak node (None when unknown)."""
        if self.peak_node is None:
            return None
        return self.modules[self.order.index(self.peak_node)]

    @property
    def peak_location(self) -> str | None:
        """``file.py:line`` of the forward call that created the peak node, when traced."""
        return self.locations.get(self.peak_node)

    def table(self) -> list[tuple[str, int]]:
        """The step budget as ``(what, bytes)`` rows (see :func:`gradscope.memory.views.budget_rows`)."""
        from gradscope.memory.replay.views import budget_rows

        return budget_rows(self)

    def to_svg(self, path=None, **kwargs) -> str:
        """The memory-over-backward curve as SVG (module bands, the peak marked): the SVG text, or with
        ``path`` the file written and its path (as ``render(path)``)."""
        from gradscope.memory.replay.views import curve_svg
        from gradscope.svgchart import svg_or_path

        return svg_or_path(curve_svg(self, **kwargs), path)

    def render(self, path, **kwargs):
        """``report.render(path)`` with the peak node marked (label ``memory peak: ...``, class
        ``gs-memory-peak`` in SVG and HTML); needs the report this replay came from to be alive."""
        report = self._report() if self._report is not None else None
        if report is None:
            raise InputValueError("render() needs the report backward_memory() was called on; keep it.")
        from gradscope._format import human_bytes

        node = report.graph.nodes.get(self.peak_node) if self.peak_node is not None else None
        if node is not None:
            node["memory_peak"] = f"memory peak: +{human_bytes(self.peak)}"
        try:
            return report.render(path, **kwargs)
        finally:
            if node is not None:
                node.pop("memory_peak", None)

    def __str__(self) -> str:
        from gradscope.memory.replay.views import text

        return text(self)

    def _repr_html_(self) -> str:
        from gradscope.memory.replay.views import repr_html

        return repr_html(self)


# NOTE [deferred fields]
# ``backward_memory()`` computes at call time what the replay itself gives (order, levels, inner, peak,
# peak_node, end, locations, the optimizer step, which reads the optimizer's current state); the fields
# below are filled from the compiled graph on first access, with the same values (a report's records do
# not change; tests/memory/test_backward_memory_compact.py checks them against a direct computation).
_DEFERRED = frozenset(
    {
        "base",
        "absolute_peak",
        "parts",
        "workspace",
        "names",
        "unmodelled",
        "unmodelled_why",
        "_reserved",
        "innode_unknown",
        "notes",
        "first_step",
        "later_step",
        "uncounted",
        "custom_runs",
    }
)
