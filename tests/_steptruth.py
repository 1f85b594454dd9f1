"""Ground truth for a whole training step on CPU, from torch.profiler
(docs/internals.md#measuring-memory-with-torchprofiler), and the real torch
APIs a what-if or a plan stands for.

``measure_step`` runs forward, backward and (optionally) ``optimizer.step()`` under
``torch.profiler.profile(profile_memory=True)`` and returns the absolute peak: the bytes that existed before
the forward (parameters, buffers, inputs, ``.grad``s, optimizer state; each storage once) plus the highest
running sum of the profiler's ``[memory]`` events during the step. ``apply_changes`` wraps modules, by
qualified name, in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` or under
``torch.autograd.graph.save_on_cpu()``, the way a user would.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint

__all__ = ["existing_bytes", "measure_step", "apply_changes"]


def _storages(tensors):
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


def existing_bytes(model, inputs, optimizer=None) -> int:
    """Bytes alive before the forward: parameters, buffers, their .grads, inputs, optimizer state."""
    ts = list(model.parameters()) + list(model.buffers())
    ts += [p.grad for p in model.parameters() if p.grad is not None]
    ts += [t for t in inputs if isinstance(t, torch.Tensor)]
    if optimizer is not None:
        for state in optimizer.state.values():
            ts += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(_storages(ts).values())


def trace_events(prof) -> tuple[list, list]:
    """The profiler's chrome-trace events, and its CPU ``[memory]`` events in time order."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    mem = [e for e in events if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0]
    mem.sort(key=lambda e: e["ts"])
    return events, mem


def _memory_curve(prof) -> tuple[list[int], int, dict]:
    """The running level after each ``[memory]`` event, the highest level before backward, and the highest
    level inside each ``gradscope-test::<phase>`` range (``backward``, ``optimizer``)."""
    events, mem = trace_events(prof)
    ranges = {e["name"].split("::")[1]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in events
              if e.get("name") in ("gradscope-test::backward", "gradscope-test::optimizer") and e.get("ph") == "X"}
    starts = [ranges["backward"][0]] if "backward" in ranges else []
    level, curve, fwd = 0, [], 0
    phases: dict[str, int] = {}
    for e in mem:
        before = level
        level += int(e["args"]["Bytes"])
        curve.append(level)
        if starts and e["ts"] < starts[0]:
            fwd = max(fwd, level)
        for name, (a, b) in ranges.items():
            if a <= e["ts"] <= b:
                phases[name] = max(phases.get(name, before), level)
    return curve, fwd, phases


def measure_step(model, inputs, loss_fn, optimizer=None) -> dict:
    """Run one step of ``loss_fn(model, *inputs)`` under the profiler; the absolute peak and its parts.

    Returns ``{"peak", "existing", "step_peak", "end", "forward_peak", "backward_peak", "optimizer_peak"}``:
    ``peak = existing + step_peak``; ``forward_peak`` is the absolute peak before backward starts,
    ``backward_peak`` / ``optimizer_peak`` the absolute peak inside ``backward()`` / ``optimizer.step()``
    (``optimizer_peak`` None without an optimizer).
    """
    gc.collect()
    base = existing_bytes(model, inputs, optimizer)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("gradscope-test::step"):
            loss = loss_fn(model, *inputs)
            with record_function("gradscope-test::backward"):
                loss.backward()
            if optimizer is not None:
                with record_function("gradscope-test::optimizer"):
                    optimizer.step()
    del loss
    curve, fwd, phases = _memory_curve(prof)
    step_peak = max([0] + curve)
    return {"peak": base + step_peak, "existing": base, "step_peak": step_peak, "end": curve[-1] if curve else 0,
            "forward_peak": base + fwd, "backward_peak": base + phases.get("backward", 0),
            "optimizer_peak": base + phases["optimizer"] if "optimizer" in phases else None}


def _checkpointed(forward):
    return functools.partial(checkpoint, forward, use_reentrant=False)


def _offloaded(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with torch.autograd.graph.save_on_cpu():
            return forward(*args, **kwargs)
    return run


def apply_changes(model, checkpoint_names=(), offload_names=()) -> None:
    """Wrap the named modules' forwards with the real torch APIs (checkpoint / save_on_cpu)."""
    for name in checkpoint_names:
        m = model.get_submodule(name)
        m.forward = _checkpointed(m.forward)
    for name in offload_names:
        m = model.get_submodule(name)
        m.forward = _offloaded(m.forward)
