"""Ground truth for memory predictions: what torch.profiler measured
(docs/internals.md#measuring-memory-with-torchprofiler).

One profiled run of a training step on CPU, ``profile_memory=True``. Every allocation and free of c10's
CPU allocator is an event in the profiler's event tree, nested under the op that made it; a running sum
gives the live-bytes curve. The forward is profiled too (the profiler does not know the size of blocks
allocated before it started). Markers: ``gs::forward``, ``gs::backward``, ``gs::step``.

    truth = measure(forward, inspect=lambda loss, model: gradscope.inspect(loss, model=model),
                    optimizer=lambda model: torch.optim.AdamW(model.parameters()))
    truth.order        # op names of the top-level evaluate_function events, in run order
    truth.levels       # bytes after each of them, relative to the start of backward
    truth.peak, truth.end, truth.step_peak (relative to the start of backward), truth.absolute_peak
    truth.report       # what inspect returned (taken inside the profiled run, before backward)

``absolute_peak`` is what-if planning's: the bytes alive before the forward (parameters, buffers, inputs, .grads
and optimizer state, counted from the objects, each storage once) plus the running sum's highest point
from the end of the forward to the end of the step.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["Truth", "measure", "storage_bytes", "op_name"]

_EVAL = "autograd::engine::evaluate_function: "


def op_name(profiler_name: str) -> str:
    """``autograd::engine::evaluate_function: torch::autograd::AccumulateGrad`` -> ``AccumulateGrad``."""
    name = profiler_name[len(_EVAL):] if profiler_name.startswith(_EVAL) else profiler_name
    return name.rsplit("::", 1)[-1]


@dataclass
class Truth:
    order: list = field(default_factory=list)
    levels: list = field(default_factory=list)
    inner: list = field(default_factory=list)
    peak: int = 0
    end: int = 0
    step_peak: int = 0
    step_end: int = 0
    before: int = 0
    at_backward: int = 0
    absolute_peak: int = 0
    report: object = None
    prediction: object = None
    nested: list = field(default_factory=list)


def storage_bytes(*groups) -> int:
    """Bytes of the distinct storages of the tensors in ``groups`` (iterables of tensors or None)."""
    seen, total = set(), 0
    for group in groups:
        for t in group:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                total += st.nbytes()
    return total


def _optimizer_tensors(opt):
    if opt is None:
        return []
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _tokens(tree):
    """Flatten the event tree: ('B', name) / ('A', bytes) / ('E', name), in time order."""
    from torch._C._profiler import _EventType

    out = []
    stack = [(n, False) for n in sorted(tree, key=lambda n: n.start_time_ns, reverse=True)]
    while stack:
        node, closing = stack.pop()
        if closing:
            out.append(("E", node.name))
            continue
        tag = node.typed[0]
        if tag == _EventType.Allocation:
            out.append(("A", int(node.typed[1].alloc_size)))
            continue
        if tag in (_EventType.TorchOp, _EventType.PyCall, _EventType.PyCCall) or True:
            interesting = node.name.startswith(_EVAL) or node.name.startswith("gs::")
            if interesting:
                out.append(("B", node.name))
                stack.append((node, True))
            for child in sorted(node.children, key=lambda n: n.start_time_ns, reverse=True):
                stack.append((child, False))
    return out


def measure(forward, *, inspect=None, optimizer=None, retain_graph=False, before=(), predict=None) -> Truth:
    """Run ``forward() -> (loss, model)`` then backward (and ``optimizer(model).step()``), profiled.

    Args:
        forward: builds the loss; tensors it returns besides are released before backward.
        inspect: ``(loss, model) -> report``, called inside the profiled run between forward and backward.
        optimizer: ``model -> torch.optim.Optimizer`` (created before the forward) or an optimizer.
        before: extra tensors alive before the forward (the input batch), for ``absolute_peak``.
        predict: ``(report, optimizer) -> prediction``, called right after ``inspect`` (before backward
            and the step); stored as ``truth.prediction``. Warm gradscope's workspace cache first: it
            does not measure while a profiler runs.
    """
    truth = Truth()
    # earlier tests' garbage, collected inside the profiled run, would read as this step's frees
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function("gs::forward"):
                loss, model = forward()
            opt = optimizer(model) if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer) \
                else optimizer
            truth.before = storage_bytes(model.parameters(), model.buffers(),
                                         (p.grad for p in model.parameters()), _optimizer_tensors(opt), before)
            if inspect is not None:
                truth.report = inspect(loss, model)
                if predict is not None:
                    truth.prediction = predict(truth.report, opt)
            with record_function("gs::backward"):
                loss.backward(retain_graph=retain_graph)
            if opt is not None:
                with record_function("gs::step"):
                    opt.step()
    finally:
        if enabled:
            gc.enable()
    tokens = _tokens(prof.profiler.kineto_results.experimental_event_tree())
    run = 0
    fwd_end = None
    b0 = None
    depth = 0
    inner = None
    high_after_fwd = None
    for kind, val in tokens:
        if kind == "A":
            run += val
            if inner is not None:
                inner = max(inner, run)
            if high_after_fwd is not None:
                high_after_fwd = max(high_after_fwd, run)
            continue
        if kind == "B":
            if val == "gs::backward":
                b0 = run
                truth.at_backward = run
            elif val.startswith(_EVAL):
                depth += 1
                if depth == 1:
                    inner = run
            continue
        if val == "gs::forward":
            fwd_end = run
            high_after_fwd = run
        elif val == "gs::backward":
            truth.end = run - b0
            truth.peak = high_after_fwd - b0
        elif val == "gs::step":
            truth.step_end = run - b0
            truth.step_peak = high_after_fwd - b0
        elif val.startswith(_EVAL):
            if b0 is None:  # a backward inside the forward (autograd.grad for a double backward)
                pass
            elif depth == 1:
                truth.order.append(op_name(val))
                truth.levels.append(run - b0)
                truth.inner.append(inner - b0)
                inner = None
            else:
                truth.nested.append(op_name(val))
            depth -= 1
    # forward-end -> step-end: what existed before + what the forward left + the highest point
    truth.absolute_peak = truth.before + high_after_fwd if fwd_end is not None else 0
    return truth
