"""What a ``torch.compile`` region (a ``CompiledFunctionBackward`` node) tells before backward runs.

AOTAutograd compiles a region's forward and keeps its backward as an FX graph until the first backward
(:func:`compiled_region`): the graph's output returns, per region input, a gradient or ``None``. An
input that gets ``None`` receives no gradient from this region even though the node has an edge to it
(a ``.detach()``, a ``no_grad`` block or ``.data`` inside the compiled code cut it there): the walk drops
those edges (``dead_inputs``), so the findings hold inside compiled code as they do in eager code.
docs/internals.md#torchcompile-regions.
"""

from __future__ import annotations

import re
import types
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from gradscope._frames import is_user_file, location_text
from gradscope._torch import forward_cls
from gradscope._torchcheck import readable

__all__ = ["COMPILED_CUTS", "Region", "read_region", "dead_inputs", "region_source", "region_attrs", "cut_event"]


#: The graph attribute the walk writes the regions' cuts to (``gradscope.graph.COMPILED_CUTS``).
COMPILED_CUTS = "compiled_cuts"

_BACKWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # forward class -> its backward graph
_READ: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backward graph -> (gets None per input, ops)


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


_REGIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # forward class -> {live edges: Region}


def read_region(node, edges) -> Region:
    """Read ``node`` (a ``CompiledFunctionBackward``) whose ``next_functions`` are ``edges``; once per
    region and pattern of live edges (a region runs the same graph every call)."""
    fwd = forward_cls(node)
    live = tuple(k for k, (child, _) in enumerate(edges) if child is not None)
    try:
        known = _REGIONS.setdefault(fwd, {}) if fwd is not None else {}
    except TypeError:  # a class that takes no weak reference: read it every time
        known = {}
    region = known.get(live)
    if region is None:
        region = known[live] = _read_region(node, list(live))
    return region


def _read_region(node, live: list) -> Region:
    got = compiled_region(node)
    if isinstance(got, str):
        return Region(frozenset(), (), got)
    meta, gm = got
    try:
        read = _READ.get(gm)
        if read is None:  # the graph is read once (a training loop's next step inspects the same region)
            out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            grads = [g is None for g in (list(out) if isinstance(out, (tuple, list)) else [out])]
            ops = tuple(_op_name(n.target) for n in gm.graph.nodes if n.op == "call_function")
            read = _READ[gm] = (grads, ops)
        none, ops = read
        wants = [bool(i.requires_grad) for i in meta.input_info]
    except (AttributeError, StopIteration, TypeError) as exc:
        return Region(frozenset(), (), f"the compiled region's backward graph is not readable ({exc})")
    grad_inputs = [i for i, w in enumerate(wants) if w]
    if len(none) != len(wants) or len(grad_inputs) != len(live):
        return Region(frozenset(), ops, "the compiled region's inputs do not match its node's edges")
    dead = frozenset(k for k, i in zip(live, grad_inputs) if none[i])
    return Region(dead, ops)


def dead_inputs(node, edges) -> tuple:
    """``edges`` with the ones that get no gradient from the compiled region replaced by ``(None, 0)``."""
    dead = read_region(node, edges).dead
    if not dead:
        return edges
    return tuple((None, 0) if k in dead else e for k, e in enumerate(edges))


# -- where the region came from (NOTE [compiled region sources], docs/internals.md#torchcompile-regions) ----
# The forward graph AOTAutograd keeps carries no ``stack_trace`` on torch 2.13 (aot_eager's is stripped,
# inductor keeps only generated code), and an input cut inside the region has no op in the backward graph:
# the line of a cut is not in the region. What is: the code dynamo compiled (the first of the region's
# ``_lazy_backward_info.saved_context.traced_code``, a resume function after a graph break), and per
# backward op its ``meta["stack_trace"]`` and ``meta["fwd_nn_module_stack"]`` (the forward op it
# differentiates: the user's line and module).

_RESUME = re.compile(r"torch_dynamo_resume_in_(\w+)_at_(\d+)$")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_FRAME_FN = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_SELF = re.compile(r"^L\['self'\]\.?")
_MAX_OPS = 5000  # ops kept per region for the picture
_ATTRS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # forward class -> (live edges, attrs)


def region_source(node) -> tuple[str | None, str | None]:
    """``(name, "file.py:LINE")`` of the Python function a region was compiled from (``"Net.forward"``,
    ``"Net.forward (after the graph break at line 14)"``); ``(None, None)`` when torch does not say."""
    info = getattr(forward_cls(node), "_lazy_backward_info", None)
    codes = getattr(getattr(info, "saved_context", None), "traced_code", None)
    code = codes[0] if isinstance(codes, list) and codes else None
    if not isinstance(code, types.CodeType):
        return _output_source(node)
    qual = getattr(code, "co_qualname", code.co_name)
    resumed = _RESUME.search(code.co_name)
    if resumed:
        owner = qual[: len(qual) - len(code.co_name)]
        line = int(resumed[2])
        return f"{owner}{resumed[1]} (after the graph break at line {line})", location_text(code.co_filename, line)
    return qual, location_text(code.co_filename, code.co_firstlineno)


def _output_source(node) -> tuple[str | None, str | None]:
    """A region served by AOTAutograd's cache keeps no TracingContext: name it after the outermost user
    frame of its first output's forward stack (``metadata.tangent_source_stack_traces``) and that line."""
    traces = getattr(getattr(forward_cls(node), "metadata", None), "tangent_source_stack_traces", None)
    for trace in traces if isinstance(traces, list) else ():
        frames = [(f, int(n), fn) for f, n, fn in _FRAME_FN.findall(trace or "") if is_user_file(f)]
        if frames:
            f, n, fn = frames[0]
            return f"{fn} (its output at line {n})", location_text(f, n)
    return None, None


def _op_name(target: Any) -> str:
    """``aten.mm.default`` -> ``mm``; a Python function (``operator.getitem``) by its name."""
    text = str(target)
    if text.startswith("<"):
        return getattr(target, "__name__", text)
    return text.replace("aten.", "").replace(".default", "")


def _user_line(trace: Any) -> str | None:
    """The innermost user frame of an FX node's ``stack_trace`` as ``file.py:LINE``."""
    if not isinstance(trace, str):
        return None
    frames = [(f, int(n)) for f, n in _FRAME.findall(trace) if is_user_file(f)]
    return location_text(*frames[-1]) if frames else None


def _module_of(stack: Any) -> str | None:
    """The innermost module of ``fwd_nn_module_stack`` (``"L['self'].blocks.0.lin"`` -> ``blocks.0.lin``)."""
    if not isinstance(stack, dict) or not stack:
        return None
    path = list(stack.values())[-1]
    path = path[0] if isinstance(path, tuple) and path else path
    if not isinstance(path, str):
        return None
    return _SELF.sub("", path) or None


def region_attrs(node) -> dict:
    """``{"compiled": {...}}``, the node attributes the picture draws a region from: ``name`` and
    ``location`` (:func:`region_source`), ``ops`` (``[op, module, "file.py:LINE", [ops it reads]]`` per
    backward op, in the graph's order; ops index into this list), ``grads`` (``{edge index: the op that
    makes that input's gradient}``), ``why`` (a sentence when the backward graph is not readable). Read
    once per region and edge pattern (a region runs the same graph every call)."""
    fwd = forward_cls(node)
    live = tuple(k for k, (child, _) in enumerate(node.next_functions) if child is not None)
    cached = _ATTRS.get(fwd) if fwd is not None else None
    if cached is not None and cached[0] == live:
        return {"compiled": _copy(cached[1])}
    got = _region_attrs(node, live)
    if fwd is not None:
        try:
            _ATTRS[fwd] = (live, _copy(got))
        except TypeError:  # a class that takes no weak reference: read it every time
            pass
    return {"compiled": got}


def _copy(attrs: dict) -> dict:
    """A copy no reader can change the cache through (plain lists: JSON values)."""
    ops = [[op, module, line, list(reads)] for op, module, line, reads in attrs["ops"]]
    return {**attrs, "ops": ops, "grads": dict(attrs["grads"])}


def _region_attrs(node, live: tuple) -> dict:
    name, where = region_source(node)
    out: dict = {"name": name, "location": where, "ops": [], "grads": {}, "why": None}
    got = compiled_region(node)
    if isinstance(got, str):
        out["why"] = got
        return out
    meta, gm = got
    try:
        index: dict = {}
        for n in gm.graph.nodes:
            if n.op == "call_function" and len(out["ops"]) < _MAX_OPS:
                index[n] = len(out["ops"])
                op = _op_name(n.target)
                reads = sorted({index[a] for a in n.all_input_nodes if a in index})
                stack, trace = n.meta.get("fwd_nn_module_stack"), n.meta.get("stack_trace")
                out["ops"].append([op, _module_of(stack), _user_line(trace), reads])
        grads = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        wants = [i for i, info in enumerate(meta.input_info) if info.requires_grad]
        if len(live) != len(wants):
            out["why"] = "the compiled region's inputs do not match its node's edges"
        else:
            for k, i in zip(live, wants):
                made = grads[i] if i < len(grads) else None
                if made in index:
                    out["grads"][str(k)] = index[made]
    except (AttributeError, TypeError, StopIteration) as exc:
        out["why"] = f"the compiled region's backward graph is not readable ({exc})"
    return out


def _params_below(child, names: dict, limit: int = 100_000) -> list[str]:
    """The named parameters whose AccumulateGrad is ``child`` or below it (the subtree a dead edge cuts)."""
    seen: set = set()
    stack, out = [child], []
    while stack and len(seen) < limit:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        var = getattr(n, "variable", None)
        if var is not None:
            named = names.get(id(var))
            if named:
                out.append(named[0])
            continue
        stack.extend(c for c, _ in n.next_functions)
    return out


def cut_event(node, edges, kept, names: dict) -> dict | None:
    """The cut a region's dead edges make, shaped as a trace event (``kind`` ``"compiled"``, ``op`` the
    region's name, ``location`` its code's line, ``params`` the named parameters below the dead edges),
    for ``graph["compiled_cuts"]``; None when no named parameter is below them."""
    params: list[str] = []
    for (child, _), (now, _) in zip(edges, kept):
        if child is not None and now is None:
            params.extend(p for p in _params_below(child, names) if p not in params)
    if not params:
        return None
    name, where = region_source(node)
    return {"kind": "compiled", "op": name or "(unnamed)", "location": where, "params": params, "seq": None}
