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


def measure_steps(model, batches, loss_fn, optimizer=None, *, steps: int = 3, accumulate: int = 1,
                  set_to_none: bool = True, before=(), retain_graph: bool = False, predict=None,
                  after_step=None) -> dict:
    """Run ``steps`` optimizer steps of a training loop under one profiler session and measure each one.

    Each step is ``accumulate`` micro-steps (``loss_fn(model, *batch).backward()``, the batch of
    ``batches(step, micro)``), then ``optimizer.step()``, then ``optimizer.zero_grad(set_to_none=...)``
    (``model.zero_grad`` without an optimizer), as a training loop runs. The absolute level is the bytes
    that existed before the profiler started (parameters, buffers, ``.grad``s, optimizer state, ``before``;
    each storage once) plus the running sum of the profiler's ``[memory]`` events. Returns
    ``{"steps": [the highest level from the start of the step's first backward to the end of its
    optimizer.step(), per step], "prediction": predict(loss, step 1's first micro-step) or None}``:
    ``predict(loss)`` is called between step 1's first forward and its backward; ``after_step()`` after
    each step's ``zero_grad`` (e.g. to drop an input batch's ``.grad``, as a new batch would).
    """
    gc.collect()
    ts = list(before)
    base = existing_bytes(model, ts, optimizer)
    # A block allocated before the profiler started and freed inside it is not reliably recorded (no
    # event, "Memory block of unknown size was allocated before the profiling started", or one with the
    # size of an older block at that address). So no such block is freed inside: the .grads that exist
    # now are held here until the end, and a step that starts after zero_grad() dropped one has its bytes
    # taken off its level (the loop would have freed them).
    pre = _pre_grads(model, ts)
    gone = [0] * steps
    prediction = None
    enabled = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            for s in range(steps):
                gone[s] = sum(n for owner, g, n in pre if owner.grad is not g)
                for k in range(accumulate):
                    loss = loss_fn(model, *batches(s, k))
                    if predict is not None and s == 0 and k == 0:
                        prediction = predict(loss)
                    with record_function(f"gs::backward::{s}"):
                        loss.backward(retain_graph=retain_graph)
                    if k + 1 < accumulate:
                        del loss
                with record_function(f"gs::optimizer::{s}"):
                    if optimizer is not None:
                        optimizer.step()
                del loss  # held through optimizer.step() (a retained graph's saved tensors with it)
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=set_to_none)
                else:
                    model.zero_grad(set_to_none=set_to_none)
                if after_step is not None:
                    after_step()
    finally:
        if enabled:
            gc.enable()
    # the event tree in order (tests/_memtruth.py): exact nesting, no timestamps to compare
    from tests._memtruth import _tokens

    level, peaks, current = 0, [0] * steps, None
    for kind, val in _tokens(prof.profiler.kineto_results.experimental_event_tree()):
        if kind == "A":
            level += val
            if current is not None:
                peaks[current] = max(peaks[current], level)
        elif kind == "B" and val.startswith("gs::backward::") and current is None:
            current = int(val.rsplit("::", 1)[1])
            peaks[current] = max(peaks[current], level)
        elif kind == "E" and val.startswith("gs::optimizer::"):
            current = None
    return {"steps": [base - g + p for p, g in zip(peaks, gone)], "prediction": prediction}


def _pre_grads(model, tensors) -> list:
    """``(owner, .grad, bytes of its storage)`` of each ``.grad`` of ``model``'s parameters and of ``tensors``
    that exists now (a storage shared by several counted once)."""
    out, seen = [], set()
    for t in list(model.parameters()) + [t for t in tensors if isinstance(t, torch.Tensor)]:
        g = t.grad
        if g is None or g.device.type != "cpu":
            continue
        st = g.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        out.append((t, g, st.nbytes()))
    return out
