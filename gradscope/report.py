"""The :class:`Report`: the graph, its findings, and every way to look at them."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import networkx as nx

from gradscope.findings import ERROR, Finding, severity_counts
from gradscope.graph import held_bytes
from gradscope.graph.jsonfile import graph_from_data, graph_to_data, read_json

if TYPE_CHECKING:  # the answers' types; the packages are imported inside the methods that need them
    import graphviz
    import torch

    from gradscope.memory.planning.maxbatch import MaxBatch
    from gradscope.memory.planning.plan import Plan
    from gradscope.memory.planning.shardplan import ShardPlan
    from gradscope.memory.planning.whatif import WhatIf
    from gradscope.memory.replay.result import BackwardMemory
    from gradscope.memory.sharding.result import ShardedStep
    from gradscope.memory.sharding.specs import DDP, FSDP
    from gradscope.memory.table import MemoryTable
    from gradscope.memory.targets import Target

#: Module names to checkpoint or offload: one qualified name or fnmatch pattern, or several.
Modules = str | Iterable[str] | None
#: A memory budget: bytes, or a size such as ``"12GiB"`` / ``"16 GB"``.
Budget = int | float | str

__all__ = ["Report", "held_bytes", "load", "report_from_data", "Modules", "Budget"]


class Report:
    """What :func:`gradscope.inspect` found.

    Attributes:
        graph: ``networkx.DiGraph`` of metadata; edge ``u -> v`` means ``v`` consumed ``u``'s output.
        findings: list of :class:`Finding`, most severe first.
        saved_bytes: bytes held by saved tensors, each storage counted once.
    """

    def __init__(self, graph: nx.DiGraph, findings: list[Finding], saved_bytes: int | None = None) -> None:
        # inspect() passes a CompactGraph (NOTE [compact records] in walk/records.py): the DiGraph is
        # built from it the first time ``graph`` is read, and the compact form is dropped then.
        self._compact = graph if hasattr(graph, "compact") else None
        self._graph = None if self._compact is not None else graph
        self.findings = list(findings)
        # inspect() passes the total its walk already summed (the same rule as held_bytes)
        self.saved_bytes = held_bytes(graph) if saved_bytes is None else saved_bytes
        #: Values other packages derive from the graph and keep with the report, so that the next question
        #: reuses them (the replay's compiled program, what-if's shared context): ``{owner key: value}``, one
        #: key per owning module (``"memory.replay.program"``). Never saved; emptied when the graph is replaced.
        self.cache: dict[str, Any] = {}
        #: Set by ``inspect(model=m)`` when ``m`` is wrapped by DDP or ``fully_shard`` on a rank: its
        #: :class:`gradscope.DDP` / :class:`gradscope.FSDP` and the rank; ``what_if()`` then uses the spec.
        self.shard: DDP | FSDP | None = None
        self.rank: int | None = None
        self.shard_error = ""  # why a wrapped model has no spec (what_if() raises it)
        self.storage_ptrs: dict | None = None  # the walk's {storage pointer: storage id}, once the DiGraph is built

    @property
    def graph(self) -> nx.DiGraph:
        """``networkx.DiGraph`` of metadata (built on first access, then always the same object)."""
        if self._graph is None:
            assert self._compact is not None  # one of the two always holds the graph (__init__, setter)
            self._graph = self._compact.compact.digraph()
            # plain integers (nothing kept alive): backward_memory(inputs=...) tells the caller's tensors
            # the budget already counts by them (memory/replay/accounting.batch_bytes)
            self.storage_ptrs = getattr(self._compact.compact, "storage_ptrs", None)
            self._compact = None
        return self._graph

    @graph.setter
    def graph(self, value: nx.DiGraph) -> None:
        self._graph, self._compact = value, None
        self.cache.clear()

    def peek_graph(self) -> Any:
        """The graph as far as it is built, without building it: the DiGraph once ``graph`` was read, else the
        compact graph of the walk, which answers ``nodes``, ``graph``, ``len`` and ``nid in`` the same way
        (for the summary, the repr and the replay's compiler, which need no DiGraph)."""
        return self._graph if self._graph is not None else self._compact

    # -- reading ---------------------------------------------------------------------------------
    @property
    def errors(self) -> list[Finding]:
        """The error-severity findings."""
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def ok(self) -> bool:
        """True when there is no error-severity finding."""
        return not self.errors

    def summary(self, top: int = 5) -> str:
        """The terminal report: counts, findings with their fixes, the top saved-memory nodes."""
        from gradscope.views.text import summary

        return summary(self, top=top)

    def explain(self, param: str) -> str:
        """Why ``param`` gets (or does not get) a gradient, in a few sentences."""
        from gradscope.checks.explain import explain

        return explain(self, param)

    def memory(self, **kwargs: Any) -> MemoryTable:
        """Saved-tensor memory per module and per op kind (see :func:`gradscope.memory.table.memory`)."""
        from gradscope.memory.table import memory

        return memory(self, **kwargs)

    def backward_memory(
        self,
        retain_graph: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
        inputs: Any = None,
        target: str | Target | None = None,
        run_custom: bool = False,
        accumulate: int = 1,
        set_to_none: bool = True,
    ) -> BackwardMemory:
        """Replay ``backward()`` (and ``optimizer.step()``) over the graph: what it will allocate and free,
        node by node, before it runs (see :func:`gradscope.memory.backward.backward_memory`). ``inputs``:
        the batch you hold through the step (tensors, or lists / dicts of them): the absolute peak counts
        it even when no op saved it (a traced forward records it). ``target``: ``"cpu"`` (default),
        ``"cuda"`` (modelled, not measured) or a ``gradscope.memory.targets.Target``. A custom
        autograd.Function's backward is run on fake tensors (no data, no memory) to measure its in-node
        memory when its code is pure tensor code; ``run_custom=True`` runs it on real random tensors instead
        (``bm.custom_runs`` says which). ``bm.absolute_peak`` is the higher of the first step (as inspected)
        and a later one (the optimizer's state alive from the start): ``bm.first_step``, ``bm.later_step``;
        ``accumulate``: backward passes per ``optimizer.step()``; ``set_to_none``: how ``zero_grad()``
        clears ``.grad`` (``False``: kept as zeros)."""
        from gradscope.memory.replay.backward import backward_memory

        return backward_memory(
            self,
            retain_graph=retain_graph,
            optimizer=optimizer,
            inputs=inputs,
            target=target,
            run_custom=run_custom,
            accumulate=accumulate,
            set_to_none=set_to_none,
        )

    def what_if(
        self,
        checkpoint: Modules = None,
        offload: Modules = None,
        batch: float = 1.0,
        optimizer: torch.optim.Optimizer | None = None,
        shard: DDP | FSDP | None = None,
        **kwargs: Any,
    ) -> WhatIf | ShardedStep:
        """The step's predicted memory with modules checkpointed / offloaded or the batch scaled by ``batch``
        (see :func:`gradscope.memory.whatif.what_if`; needs ``inspect(..., trace=tr)``); with ``shard=`` a
        :class:`gradscope.DDP` / :class:`gradscope.FSDP`, the per-rank step (see
        :func:`gradscope.memory.planning.sharded.sharded_what_if`)."""
        if shard is None and self.shard_error:
            from gradscope.errors import InputValueError

            raise InputValueError(self.shard_error)
        if shard is None and self.shard is not None:  # inspected on a rank of a wrapped model
            shard = self.shard
        if shard is not None:
            from gradscope.memory.planning.sharded import sharded_what_if

            step = sharded_what_if(self, shard, checkpoint, offload, batch, optimizer, **kwargs)
            step.rank = self.rank if shard is self.shard else None
            return step
        from gradscope.memory.planning.whatif import what_if

        return what_if(self, checkpoint, offload, batch, optimizer, **kwargs)

    def plan(self, budget: Budget, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> Plan | ShardPlan:
        """The cheapest modules to checkpoint (and offload) so that the step fits ``budget`` (see
        :func:`gradscope.memory.plan.plan`); with ``shard=`` a spec or ``"auto"``, per rank (see
        :func:`gradscope.memory.planning.shardplan.shard_plan`)."""
        if kwargs.get("shard") is not None:
            from gradscope.memory.planning.shardplan import shard_plan

            return shard_plan(self, budget, optimizer, **kwargs)
        from gradscope.memory.planning.plan import plan

        return plan(self, budget, optimizer, **kwargs)

    def max_batch(self, budget: Budget, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> MaxBatch:
        """The largest batch whose predicted step fits ``budget`` (see :func:`gradscope.memory.plan.max_batch`);
        with ``shard=`` a spec, per rank (its ceiling)."""
        if kwargs.get("shard") is not None:
            from gradscope.memory.planning.shardplan import sharded_max_batch

            return sharded_max_batch(self, budget, optimizer, **kwargs)
        from gradscope.memory.planning.plan import max_batch

        return max_batch(self, budget, optimizer, **kwargs)

    # -- views -----------------------------------------------------------------------------------
    def render(self, path: str | os.PathLike, **kwargs: Any) -> str:
        """Write the graph to ``path``; the format comes from the suffix (see :func:`gradscope.views.render.render`)."""
        from gradscope.views.render import render

        return render(self, path, **kwargs)

    def to_dot(self, **kwargs: Any) -> graphviz.Digraph:
        """The graph as a ``graphviz.Digraph`` (see :func:`gradscope.views.render.to_dot`)."""
        from gradscope.views.render import to_dot

        return to_dot(self, **kwargs)

    # -- persistence (the report saves and reads itself; views call these) ----------------------
    def to_json(self) -> dict:
        """JSON-ready node-link data of the graph, with findings (what ``render('x.json')`` writes).

        ``findings`` and ``saved_bytes`` ride in the graph attributes; :meth:`from_json` reads them back.
        """
        findings = [f.to_dict() for f in self.findings]
        return graph_to_data(self.graph, findings=findings, saved_bytes=self.saved_bytes)

    @classmethod
    def from_json(cls, data: dict, source: str = "the report") -> Report:
        """Rebuild a report from :meth:`to_json` data (checks are not re-run: the findings are stored).

        Raises:
            InputValueError: ``data`` is not a gradscope report (the first bad field is named).
        """
        graph = graph_from_data(data, source)
        findings = [Finding.from_dict(f) for f in graph.graph.pop("findings", [])]
        graph.graph.pop("saved_bytes", None)
        return cls(graph, findings)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Report:
        """Read a report written by ``report.render("x.json")`` (what :func:`gradscope.load` does).

        Raises:
            InputTypeError: ``path`` is not a str or path-like object.
            InputValueError: the file is missing, is not JSON, or is not a gradscope report.
        """
        data, shown = read_json(path)
        return cls.from_json(data, shown)

    def _repr_html_(self) -> str:
        from gradscope.views.notebook import repr_html

        return repr_html(self)

    def _repr_mimebundle_(self, include: Iterable[str] | None = None, exclude: Iterable[str] | None = None) -> dict:
        from gradscope.views.notebook import repr_mimebundle

        return repr_mimebundle(self, include=include, exclude=exclude)

    def __repr__(self) -> str:
        found = severity_counts(self.findings) or "no findings"
        from gradscope._format import human_bytes

        return (
            f"<gradscope.Report: {self.peek_graph().number_of_nodes()} nodes, "
            f"{human_bytes(self.saved_bytes)} saved, {found}>"
        )

    def __str__(self) -> str:
        return self.summary()


def report_from_data(data: dict, source: str = "the report") -> Report:
    """Rebuild a :class:`Report` from ``report.to_json()`` data (:meth:`Report.from_json`)."""
    return Report.from_json(data, source)


def load(path: str | os.PathLike) -> Report:
    """Read a report written by ``report.render("x.json")`` (:meth:`Report.load`).

    Raises:
        InputValueError: the file is missing, is not JSON, or is not a gradscope report.
    """
    return Report.load(path)
