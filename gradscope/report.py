"""The :class:`Report`: the graph, its findings, and every way to look at them."""

from __future__ import annotations

import networkx as nx

from gradscope.findings import Finding
from gradscope.walk.saved import HELD

__all__ = ["Report", "held_bytes"]



def held_bytes(graph, nodes=None) -> int:
    """Bytes held by saved tensors in ``graph`` (or only in ``nodes``), each storage counted once.

    Wrapped Python scalars are left out, as are slots that hold nothing on the device (recomputed,
    offloaded, freed).
    """
    seen: set = set()
    total = 0
    attrs = graph.nodes
    for data in (attrs.values() if nodes is None else (attrs[n] for n in nodes)):
        for e in data["saved"]:
            if e["status"] not in HELD or e.get("scalar"):
                continue
            sid = e["storage"]
            if sid is not None:
                if sid in seen:
                    continue
                seen.add(sid)
            total += e["nbytes"]
    return total


class Report:
    """What :func:`gradscope.inspect` found.

    Attributes:
        graph: ``networkx.DiGraph`` of metadata; edge ``u -> v`` means ``v`` consumed ``u``'s output.
        findings: list of :class:`Finding`, most severe first.
        saved_bytes: bytes held by saved tensors, each storage counted once.
    """

    def __init__(self, graph: nx.DiGraph, findings: list[Finding], saved_bytes: int | None = None):
        self.graph = graph
        self.findings = list(findings)
        # inspect() passes the total its walk already summed (the same rule as held_bytes)
        self.saved_bytes = held_bytes(graph) if saved_bytes is None else saved_bytes

    # -- reading ---------------------------------------------------------------------------------
    @property
    def errors(self) -> list[Finding]:
        """The error-severity findings."""
        return [f for f in self.findings if f.severity == "error"]

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

    def memory(self, **kwargs):
        """Saved-tensor memory per module and per op kind (see :func:`gradscope.memory.table.memory`)."""
        from gradscope.memory.table import memory

        return memory(self, **kwargs)

    def backward_memory(self, retain_graph: bool = False, optimizer=None):
        """Replay ``backward()`` (and ``optimizer.step()``) over the graph: what it will allocate and free,
        node by node, before it runs (see :func:`gradscope.memory.backward.backward_memory`)."""
        from gradscope.memory.backward import backward_memory

        return backward_memory(self, retain_graph=retain_graph, optimizer=optimizer)

    def what_if(self, checkpoint=None, offload=None, batch: float = 1.0, optimizer=None, **kwargs):
        """The step's predicted memory with modules checkpointed / offloaded or the batch scaled by ``batch``
        (see :func:`gradscope.memory.whatif.what_if`; needs ``inspect(..., trace=tr)``)."""
        from gradscope.memory.whatif import what_if

        return what_if(self, checkpoint, offload, batch, optimizer, **kwargs)

    def plan(self, budget, optimizer=None, **kwargs):
        """The cheapest modules to checkpoint (and offload) so that the step fits ``budget`` (see
        :func:`gradscope.memory.plan.plan`)."""
        from gradscope.memory.plan import plan

        return plan(self, budget, optimizer, **kwargs)

    def max_batch(self, budget, optimizer=None, **kwargs):
        """The largest batch whose predicted step fits ``budget`` (see :func:`gradscope.memory.plan.max_batch`)."""
        from gradscope.memory.plan import max_batch

        return max_batch(self, budget, optimizer, **kwargs)

    # -- views -----------------------------------------------------------------------------------
    def render(self, path, **kwargs):
        """Write the graph to ``path``; the format comes from the suffix (see :func:`gradscope.views.render.render`)."""
        from gradscope.views.render import render

        return render(self, path, **kwargs)

    def to_dot(self, **kwargs):
        """The graph as a ``graphviz.Digraph`` (see :func:`gradscope.views.render.to_dot`)."""
        from gradscope.views.render import to_dot

        return to_dot(self, **kwargs)

    def to_json(self) -> dict:
        """JSON-ready node-link data of the graph, with findings (what ``render('x.json')`` writes)."""
        from gradscope.views.serialize import report_to_data

        return report_to_data(self)

    def _repr_html_(self) -> str:
        from gradscope.views.notebook import repr_html

        return repr_html(self)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        from gradscope.views.notebook import repr_mimebundle

        return repr_mimebundle(self, include=include, exclude=exclude)

    def __repr__(self) -> str:
        counts = {}
        for f in self.findings:
            counts[f.severity] = counts.get(f.severity, 0) + 1
        found = ", ".join(f"{n} {s}{'s' if n > 1 else ''}" for s, n in counts.items()) or "no findings"
        from gradscope._format import human_bytes

        return (f"<gradscope.Report: {self.graph.number_of_nodes()} nodes, "
                f"{human_bytes(self.saved_bytes)} saved, {found}>")

    def __str__(self) -> str:
        return self.summary()
