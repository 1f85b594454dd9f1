"""What one replay keeps for the fields of :class:`~gradscope.memory.replay.result.BackwardMemory` that are
read later (NOTE [deferred fields] in result.py): the step's base by part, the first and the later steps
(steady.py NOTE [first and later steps]), the peak's contributors; all read from the compiled graph, which
nothing changes. ``backward.replay()`` makes one per call.
"""

from __future__ import annotations

from gradscope.graph import BATCH, EVENTS
from gradscope.memory.replay.accounting import batch_bytes, peak_blocks, peak_by_module, step_base
from gradscope.memory.replay.engine import Program, reentrant_nodes
from gradscope.memory.replay.reentrant import modelled_region, node_effect
from gradscope.memory.replay.simulate import Trace, simulate
from gradscope.memory.replay.steady import StepPeak, steps_of

__all__ = ["Replayed", "unmodelled_regions"]


class Replayed:
    """What one replay keeps for the fields of :class:`BackwardMemory` read later (NOTE [deferred fields]):
    read from the compiled graph only, which nothing changes."""

    def __init__(self, prog, graph, tr, sim, sizes, drop, has_grad, ov, alloc, target, inputs, step, inn, ws, high):
        self.prog, self.graph, self.tr, self.sim, self.sizes, self.drop = prog, graph, tr, sim, sizes, drop
        self.has_grad, self.ov, self.alloc, self.target, self.inputs = has_grad, ov, alloc, target, inputs
        self.step, self.inn, self.ws, self.high = step, inn, ws, high
        self.snaps: list = []
        self.step_peaks: list = []
        self.traces: dict = {}
        self.later_budget = None
        self.ptrs: dict | None = None
        self.variants: tuple = ({}, {})

    def snapshot(self) -> Trace:
        """What is alive at backward's peak, simulated again once, when asked."""
        if not self.snaps:
            self.snaps.append(self.sim(snapshot_at=self.tr.peak_at))
        return self.snaps[0]

    def contributors(self) -> list[tuple[str, str, int]]:
        snap = self.snapshot()
        return peak_by_module(self.prog, snap.snapshot or {}, snap.origin, self.sizes, self.drop)

    def reserved(self, parts: dict) -> int:
        return self.target.reserved(peak_blocks(self.graph, self.snapshot().snapshot or {}, parts, self.alloc))

    def base_parts(self, has_grad: dict | None = None, others=None, state: int | None = None) -> dict:
        """Bytes alive when backward starts, by part (``.grad`` as ``has_grad`` says, default as inspected;
        ``others``: ``step_base``'s; ``state``: optimizer state bytes, default as inspected)."""
        prog, graph, ov = self.prog, self.graph, self.ov
        hg = self.has_grad if has_grad is None else has_grad
        parts = step_base(prog, graph, self.sizes, self.drop, hg, ov.scale, self.alloc, others)
        parts.update(self.target.fixed_parts(prog.name))
        batch = self.inputs if self.inputs is not None else graph.graph.get(BATCH)  # NOTE [the traced batch]
        if batch is not None:
            ptrs = getattr(getattr(graph, "compact", None), "storage_ptrs", None) or self.ptrs
            parts["batch"] = batch_bytes(prog, graph, batch, self.sizes, self.drop, ptrs, ov.scale)
        if self.step is not None:
            parts["optimizer state"] = self.step.state_before if state is None else state
        return parts

    def uncounted(self) -> list[str]:
        """What may be alive when backward starts and is not in ``base`` (NOTE [the traced batch])."""
        if self.inputs is not None or BATCH in self.graph.graph or EVENTS in self.graph.graph:
            return []
        return [
            "the batch you hold through the step is counted only where an op saved it, so the absolute peak "
            "can be low by the rest of it: pass it as inputs=, or run the forward under gradscope.trace()"
        ]

    def trace_of(self, has_grad: dict) -> Trace:
        """The backward simulated with ``.grad`` set as ``has_grad`` says (each variant once)."""
        key = tuple(sorted(has_grad.items()))
        got = self.traces.get(key)
        if got is None:
            got = self.traces[key] = self.sim(has_grad=has_grad)
        return got

    def steps(self) -> tuple[StepPeak, StepPeak]:
        if not self.step_peaks:
            self.traces = {tuple(sorted(self.has_grad.items())): self.tr}
            self.step_peaks.extend(
                steps_of(
                    parts_of=self.base_parts,
                    trace_of=self.trace_of,
                    cur=self.has_grad,
                    variants=self.variants,
                    first_budget=self.step,
                    later_budget=self.later_budget,
                    accumulate=max(1, int(self.ov.accumulate)),
                    set_to_none=bool(self.ov.set_to_none),
                )
            )
        first, later = self.step_peaks
        return first, later

    def fields(self) -> dict:
        prog, inn, ids = self.prog, self.inn, self.prog.ids
        parts = self.base_parts()
        base = sum(parts.values())
        first, later = self.steps()
        unmodelled, why = unmodelled_regions(prog)
        unknown = {ids[v]: r for v, r in inn.unmodelled.items()}
        unmodelled += [n for n in unknown if n not in why]
        notes = list(inn.notes)
        if inn.extrapolated:
            n = len(inn.extrapolated)
            notes.append(
                f"In-node memory of {n} node{'s' if n > 1 else ''} was extrapolated from measurements at smaller "
                "sizes (tensors above 1 MiB)."
            )
        return {
            "base": base,
            "absolute_peak": max(base + max(self.high, 0), later.absolute_peak),
            "uncounted": self.uncounted(),
            "first_step": first,
            "later_step": later,
            "parts": parts,
            "workspace": {ids[v]: w for v, w in self.ws.items()},
            "names": list(map(prog.name.__getitem__, self.tr.order)),
            "unmodelled": unmodelled,
            "unmodelled_why": {**unknown, **why},
            "innode_unknown": unknown,
            "notes": notes,
            "custom_runs": {ids[v]: h for v, h in inn.how.items()},
            "_reserved": lambda: self.reserved(parts),
        }


def unmodelled_regions(prog: Program) -> tuple[list, dict]:
    """Node ids of the reentrant checkpoint regions the replay could not model (see BackwardMemory), and
    for the traced ones why their recording could not be used."""
    out, why = [], {}
    for v, extra in reentrant_nodes(prog):
        rec = modelled_region(extra)
        if rec is None or node_effect(prog, v, rec, simulate) is None:  # a traced one may fail on meta
            nid = prog.ids[v]
            out.append(nid)
            traced = (extra.get("region_recompute") or {}).get("traced") or {}
            reason = traced.get("reason") or traced.get("replay")
            if reason:
                why[nid] = reason
    return out, why
