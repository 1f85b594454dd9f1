"""One sweep measurement: gradscope's predictions on a model vs what backward() does."""

from __future__ import annotations

import time

import torch

import gradscope

from .fuzz._oracle import packed_bytes

__all__ = ["measure"]


def measure(build, seed: int = 0, repeats: int = 1) -> dict:
    """Build, inspect, backward; return predictions, torch's truth and the numbers for the table."""
    torch.manual_seed(seed)
    model, make_loss = build()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(seed + 1)
    loss = make_loss()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        report = gradscope.inspect(loss, model=model)
        times.append(time.perf_counter() - t0)
    loss.backward()
    truth_none = {n for n, p in model.named_parameters() if p.requires_grad and p.grad is None}
    hard = {p for f in report.findings if f.severity == "error"
            and f.kind in ("unused-parameter", "detached-branch") for p in f.params}
    soft = {p for f in report.findings if f.severity != "error" and f.kind == "unused-parameter"
            for p in f.params}
    other_errors = [f for f in report.findings if f.severity == "error"
                    and f.kind not in ("unused-parameter", "detached-branch")]
    del loss
    model.load_state_dict(state)
    torch.manual_seed(seed + 1)
    packed = packed_bytes(make_loss)
    hidden = any(d["name"] == "CopySlices" for _, d in report.graph.nodes(data=True))
    return {
        "nodes": report.graph.number_of_nodes(),
        "params": sum(1 for p in model.parameters() if p.requires_grad),
        "saved_bytes": report.saved_bytes,
        "packed_bytes": packed,
        "hidden": hidden,
        "inspect_s": sorted(times)[len(times) // 2],
        "predicted_none": hard,
        "maybe_none": soft,
        "truth_none": truth_none,
        "other_errors": other_errors,
        "findings": report.findings,
    }
