"""``gradscope.inspect``: roots in, :class:`~gradscope.report.Report` out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gradscope._torchcheck import WALK, require
from gradscope.checks import run_checks
from gradscope.report import Report
from gradscope.walk.build import build, flatten_roots
from gradscope.walk.compact import CompactGraph
from gradscope.walk.named import names_and_buffers
from gradscope.walk.records import node_id

if TYPE_CHECKING:
    import torch

    from gradscope.tracing.recorder import Trace

__all__ = ["inspect"]


def inspect(
    root: torch.Tensor | Sequence[Any],
    *,
    model: torch.nn.Module | None = None,
    params: Mapping[str, torch.Tensor] | None = None,
    trace: Trace | None = None,
) -> Report:
    """Walk the autograd graph behind ``root`` and diagnose it, before (or after) ``backward()``.

    Args:
        root: the loss tensor, or a (nested) list/tuple of tensors you would pass to
            ``torch.autograd.backward``.
        model: an ``nn.Module`` whose ``named_parameters()`` name the leaves (DDP/DataParallel are
            unwrapped, so names carry no ``module.`` prefix; FSDP2's unsharded parameters are named after
            the sharded ones). A DDP or ``fully_shard``-ed model sets ``report.shard`` (its spec) and
            ``report.rank``: ``what_if()`` then predicts the per-rank step as ``what_if(shard=...)`` would.
        params: a mapping of names to tensors, in addition to or instead of ``model``.
        trace: a finished :func:`gradscope.trace` recording of the same forward pass; it adds module
            names to op nodes and the source location of cuts and in-place writes.

    Returns:
        A :class:`Report` holding only metadata: no tensor or autograd node stays alive because of it.

    Raises:
        InputTypeError: ``root`` is not a tensor or a list of tensors; ``model``/``params`` have the
            wrong type.
        NoGradRootError: no root has a ``grad_fn`` or requires grad.

    Example:
        >>> import torch, gradscope
        >>> lin = torch.nn.Linear(3, 1)
        >>> report = gradscope.inspect(lin(torch.randn(2, 3)).sum(), model=lin)
        >>> report.findings
        []
    """
    require(*WALK)  # one sentence when this torch moved what the walk reads (and what still works)
    roots = flatten_roots(root)
    names, buffers = names_and_buffers(model, params)  # NOTE [model structure cache]
    records = build(roots, names, buffers)
    graph = CompactGraph(records)  # the DiGraph is built only when report.graph is first read
    if trace is not None:
        _annotate(trace, graph, model, names)
    special = [node_id(i) for i in records.special]
    report = Report(graph, run_checks(graph, special), saved_bytes=records.held_total)
    if model is not None:  # a model wrapped by DDP / FSDP2 on a rank: what_if() predicts this rank's step
        from gradscope.errors import InputValueError
        from gradscope.memory.sharding.wrapped import wrapped_spec

        try:
            report.shard, report.rank = wrapped_spec(model) or (None, None)
        except InputValueError as e:  # the findings stand; what_if() says why it cannot predict the rank
            report.shard_error = str(e)
    return report


def _annotate(trace, graph, model, names) -> None:
    from gradscope.errors import InputTypeError

    annotate = getattr(trace, "annotate", None)
    if annotate is None:
        raise InputTypeError(f"trace= must be the object returned by gradscope.trace(), got {type(trace).__name__}.")
    annotate(graph, model, names=names)
    hf = _hf_checkpointing(model)
    if hf:
        from gradscope.graph import HF_CHECKPOINTING

        graph.graph[HF_CHECKPOINTING] = hf


def _hf_checkpointing(model) -> dict | None:
    """A Hugging Face model's own checkpointing switch and the layers it wraps (class names only: no import
    of transformers), or None."""
    if model is None or not getattr(model, "supports_gradient_checkpointing", False):
        return None
    method = next(
        (m for m in ("activation_checkpointing_enable", "gradient_checkpointing_enable") if hasattr(model, m)), None
    )
    layers = [
        name
        for name, m in model.named_modules()
        if name and any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)
    ]
    return {"layers": layers, "method": method} if method and layers else None
