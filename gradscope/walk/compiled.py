"""What a ``torch.compile`` region (a ``CompiledFunctionBackward`` node) tells before backward runs.

AOTAutograd compiles a region's forward and keeps its backward as an FX graph until the first backward
(:func:`compiled_region`): the graph's output returns, per region input, a gradient or ``None``. An
input that gets ``None`` receives no gradient from this region even though the node has an edge to it
(a ``.detach()``, a ``no_grad`` block or ``.data`` inside the compiled code cut it there): the walk drops
those edges (``dead_inputs``), so the findings hold inside compiled code as they do in eager code.
docs/internals.md#torchcompile-regions.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from gradscope._torch import forward_cls
from gradscope._torchcheck import readable

__all__ = ["Region", "read_region", "dead_inputs"]


_BACKWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # forward class -> its backward graph


def _deserialized_backward(fwd: Any, info: Any) -> Any:
    """The backward graph of a region that inductor's FX graph cache served: ``info.bw_module_fn()`` rebuilds
    the ``fx.GraphModule`` from its code (nothing runs), once per region."""
    module = _BACKWARDS.get(fwd)
    if module is None:
        try:
            module = info.bw_module_fn()
        except Exception:  # noqa: BLE001 - a cache entry torch cannot rebuild: "not readable"
            return None
        _BACKWARDS[fwd] = module
    return module


def compiled_region(node: Any) -> tuple[Any, Any] | str:
    """``(metadata, backward graph)`` of a ``CompiledFunctionBackward`` node: its forward class's
    ``metadata`` (AOTAutograd's ``ViewAndMutationMeta``: ``input_info[i].requires_grad`` per region input,
    symbolic sizes included) and ``_lazy_backward_info.bw_module`` (the backward ``fx.GraphModule``, kept
    after the backward is compiled; its output returns one gradient or None per region input). A sentence
    saying what is not readable when either is missing. docs/internals.md#torchcompile-regions."""
    unread = readable("compiled-regions")
    if unread is not None:
        return unread
    fwd = forward_cls(node)
    meta = getattr(fwd, "metadata", None)
    info = getattr(fwd, "_lazy_backward_info", None)
    module = getattr(info, "bw_module", None)
    if module is None and callable(getattr(info, "bw_module_fn", None)):
        module = _deserialized_backward(fwd, info)
    graph = getattr(module, "graph", None)
    if meta is None or getattr(meta, "input_info", None) is None:
        return f"the compiled region's metadata is not readable on torch {torch.__version__}"
    if graph is None:
        return (
            f"the compiled region's backward graph is not readable on torch {torch.__version__} "
            "(or it was dropped after compiling)"
        )
    return meta, module


@dataclass(frozen=True)
class Region:
    """A compiled region as plain data (no tensor, no graph kept).

    ``dead``: positions in the node's ``next_functions`` that get no gradient from the region's backward.
    ``ops``: the backward graph's operator names in order (``aten.mm``...), for the picture.
    ``why``: a sentence when the region could not be read (then ``dead`` is empty: nothing is guessed).
    """

    dead: frozenset[int]
    ops: tuple[str, ...]
    why: str | None = None


_NOTHING = Region(frozenset(), ())


def read_region(node, edges) -> Region:
    """Read ``node`` (a ``CompiledFunctionBackward``) whose ``next_functions`` are ``edges``."""
    got = compiled_region(node)
    if isinstance(got, str):
        return Region(frozenset(), (), got)
    meta, gm = got
    try:
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        grads = list(out) if isinstance(out, (tuple, list)) else [out]
        wants = [bool(i.requires_grad) for i in meta.input_info]
        ops = tuple(str(n.target).replace("aten.", "").replace(".default", "") for n in gm.graph.nodes
                    if n.op == "call_function")  # fmt: skip
    except (AttributeError, StopIteration, TypeError) as exc:
        return Region(frozenset(), (), f"the compiled region's backward graph is not readable ({exc})")
    live = [k for k, (child, _) in enumerate(edges) if child is not None]
    grad_inputs = [i for i, w in enumerate(wants) if w]
    if len(grads) != len(wants) or len(grad_inputs) != len(live):
        return Region(frozenset(), ops, "the compiled region's inputs do not match its node's edges")
    dead = frozenset(k for k, i in zip(live, grad_inputs) if grads[i] is None)
    return Region(dead, ops)


def dead_inputs(node, edges) -> tuple:
    """``edges`` with the ones that get no gradient from the compiled region replaced by ``(None, 0)``."""
    dead = read_region(node, edges).dead
    if not dead:
        return edges
    return tuple((None, 0) if k in dead else e for k, e in enumerate(edges))
