"""``torch.compile`` regions gradscope could not read: their parameters may get no gradient unseen.

A region whose backward graph is readable drops the edges it sends no gradient along (walk/compiled.py),
so ``unused.check`` sees its cuts. One whose graph is not (a torch that drops it, a cache entry torch
cannot rebuild) keeps every edge: the parameters it reads look reached whether or not they are. Saying
so, with what to do, is the only honest answer (docs/internals.md#torchcompile-regions).
"""

from __future__ import annotations

from collections.abc import Iterator

from gradscope.checks._nodes import node_items
from gradscope.findings import UNUSED_PARAMETER, WARNING, Finding

__all__ = ["check", "unread_regions", "describe_cut", "CUT_FIX", "UNREAD_FIX"]

#: What to do about a cut inside a compiled region (``unused.cut_fix``).
CUT_FIX = (
    "Record the forward with gradscope.trace() to see the line of the cut, then remove it, or freeze "
    "the parameters (requires_grad_(False)) if that is intended."
)

#: What to do about a region whose backward graph is not readable (the warning and ``explain()``).
UNREAD_FIX = "Inspect before the first backward(), or call torch._dynamo.reset() and run the forward again"


def describe_cut(ev: dict) -> str:
    """The words of a ``graph["compiled_cuts"]`` event (``unused.describe_cut``): the region and its line."""
    return (
        f"cut inside the torch.compile region {ev['op']} ({ev.get('location') or 'location unknown'}): the "
        "region's backward graph returns no gradient for it (a .detach(), .data or torch.no_grad() in the "
        "compiled code; the compiled graph keeps no line for the cut itself)"
    )


def unread_regions(graph, nodes=None) -> list[tuple[str, dict]]:
    """``(node id, its "compiled" attribute)`` of the compiled regions whose backward graph was not read."""
    out = []
    for n, d in node_items(graph, nodes):
        region = (d.get("attrs") or {}).get("compiled") if d["kind"] == "op" else None
        if isinstance(region, dict) and region.get("why"):
            out.append((n, region))
    return out


def check(graph, nodes=None) -> Iterator[Finding]:
    """One warning per unreadable region that reads trainable parameters."""
    for n, region in unread_regions(graph, nodes):
        params = [
            graph.nodes[p]["name"]
            for p in graph.predecessors(n)
            if graph.nodes[p]["kind"] == "param" and graph.nodes[p].get("requires_grad", True)
        ]
        if not params:
            continue
        name = region.get("name") or graph.nodes[n]["name"]
        where = f" ({region['location']})" if region.get("location") else ""
        shown = ", ".join(params[:3]) + (f" and {len(params) - 3} more" if len(params) > 3 else "")
        yield Finding(
            UNUSED_PARAMETER,
            WARNING,
            f"The torch.compile region {name}{where} is not readable: {region['why']}. Whether {shown} get a "
            "gradient from it is not known (a .detach(), .data or no_grad inside it would cut them unseen). "
            f"{UNREAD_FIX} before inspect(); check .grad after backward() to be sure.",
            node=n,
            params=tuple(params),
            location=region.get("location"),
        )
