"""Root checks: ``non-scalar-root`` and ``no-grad-root``."""

from __future__ import annotations

from collections.abc import Iterator

from gradscope.findings import ERROR, NO_GRAD_ROOT, NON_SCALAR_ROOT, WARNING, Finding
from gradscope.graph import NO_GRAD_ROOTS, ROOT_SHAPES, ROOTS

__all__ = ["check"]


def check(graph, nodes=None) -> Iterator[Finding]:
    """Flag roots that ``backward()`` cannot start from as they are."""
    for rid, shape in zip(graph.graph.get(ROOTS, ()), graph.graph.get(ROOT_SHAPES, ())):
        numel = None if shape is None else 1  # None: a nested tensor, never a scalar
        for s in shape or ():
            numel *= s
        if numel != 1:
            name = graph.nodes[rid]["name"]
            what = "a nested tensor" if shape is None else f"shape {tuple(shape)}"
            yield Finding(
                NON_SCALAR_ROOT,
                WARNING,
                f"The root ({name}, {what}) is not a scalar, so loss.backward() raises "
                "'grad can be implicitly created only for scalar outputs'. Reduce it first "
                "(loss.mean() or loss.sum()) or pass gradient=torch.ones_like(loss).",
                node=rid,
                location=graph.nodes[rid].get("location"),  # traced: the line that computed the root
            )
    for index in graph.graph.get(NO_GRAD_ROOTS, ()):
        yield Finding(
            NO_GRAD_ROOT,
            ERROR,
            f"Root {index} has no grad_fn and does not require grad: it was computed under torch.no_grad()"
            " or inference_mode, detached, or from inputs that need no gradient, so backward() through it "
            "raises. Compute it with grad enabled, or drop it from the roots.",
        )
