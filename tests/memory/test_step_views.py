"""The step budget and the memory charts tell the truth: the table's phases (peak during backward, peak
during ``optimizer.step()``) against torch.profiler's peak inside each phase, the step's peak as their
maximum, and each chart's peak drawn where it happens, in absolute bytes."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

import gradscope
from gradscope.memory.planning.planview import BACKWARD_SHARE
from tests._steptruth import measure_step

TOL = 0.02
NS = "{http://www.w3.org/2000/svg}"


def _mlp(d):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))


def _loss(model, x):
    return model(x).pow(2).mean()


#: name -> (width, batch, the phase that holds the step's peak): wide activations peak in backward, wide
#: parameters in AdamW's first step (it creates two parameter-sized states).
CASES = {"activations": (64, 2048, "backward"), "parameters": (512, 4, "AdamW.step()")}


def _step(name):
    d, b, _ = CASES[name]
    model = _mlp(d)
    x = torch.randn(b, d)
    with gradscope.trace(model) as tr:
        loss = _loss(model, x)
    report = gradscope.inspect(loss, model=model, trace=tr)
    opt = torch.optim.AdamW(model.parameters())
    return report, report.backward_memory(optimizer=opt), model, x, opt, loss


@pytest.mark.parametrize("name", list(CASES))
def test_the_table_shows_phases_and_the_peak_is_their_maximum(name):
    report, bm, model, x, opt, loss = _step(name)
    rows = dict(bm.table())
    phases = {k: v for k, v in rows.items() if k.startswith("peak during ")}  # the first step's
    assert list(phases) == ["peak during backward", "peak during AdamW.step()"]
    assert rows["peak of the first step"] == max(phases.values()) == bm.first_step.absolute_peak
    later = {k: v for k, v in rows.items() if k.startswith("later steps: peak during ")}
    assert rows["peak of a later step"] == max(later.values()) == bm.later_step.absolute_peak
    assert rows["absolute peak of the step"] == bm.absolute_peak == max(max(phases.values()), max(later.values()))
    parts = sum(v for k, v in bm.parts.items())
    assert rows["alive when backward starts"] == parts == bm.base
    assert sum(rows.values()) > 2 * bm.absolute_peak           # the rows are not terms of a sum
    top = max(phases, key=lambda k: phases[k]).removeprefix("peak during ")
    assert top == CASES[name][2]
    text = str(bm)
    assert "not a sum of the rows" in text and f"(max of the phases: during {top})" in text
    del report, loss
    model.zero_grad(set_to_none=True)
    truth = measure_step(model, (x,), _loss, torch.optim.AdamW(model.parameters()))
    for measured, predicted in ((truth["backward_peak"], phases["peak during backward"]),
                                (truth["optimizer_peak"], phases["peak during AdamW.step()"]),
                                (truth["peak"], bm.first_step.absolute_peak)):
        assert abs(predicted - measured) <= TOL * measured, (name, predicted, measured)


def _points(poly) -> list[tuple[float, float]]:
    return [tuple(map(float, p.split(","))) for p in poly.get("points").split()]


@pytest.mark.parametrize("name", list(CASES))
def test_the_what_if_chart_draws_each_peak_where_it_happens(name):
    report, bm, model, *_rest = _step(name)
    wi = report.what_if(checkpoint=["0"], optimizer=torch.optim.AdamW(model.parameters()))
    root = ET.fromstring(wi.to_svg())
    frame = next(e for e in root.iter(NS + "rect") if e.get("fill") == "none")
    left, width = float(frame.get("x")), float(frame.get("width"))
    end_of_backward = left + width * BACKWARD_SHARE
    curves = [e for e in root.iter(NS + "polyline") if e.get("class") == "curve"]
    peaks = [e for e in root.iter(NS + "circle") if e.get("class") == "peak"]
    assert len(curves) == len(peaks) == 2
    for curve, peak, memory in zip(curves, peaks, (wi.baseline, wi.memory)):
        pts = _points(curve)
        cx, cy = float(peak.get("cx")), float(peak.get("cy"))
        assert abs(cy - min(y for _, y in pts)) < 0.11          # the marked point is the curve's highest
        assert any(abs(x - cx) < 0.11 and abs(y - cy) < 0.11 for x, y in pts)
        in_step = memory.base + memory.end + memory.step.peak > memory.base + memory.peak
        if in_step:
            assert cx > end_of_backward + 1, (name, cx, end_of_backward)
        else:                                                   # at its node of backward, not at the end
            i = memory.order.index(memory.peak_node)
            assert abs(cx - (left + width * BACKWARD_SHARE * (i + 0.5) / len(memory.order))) < 0.11
            assert cx < end_of_backward
        where = "during optimizer.step()" if in_step else "during backward"
        assert where in (peak.findtext(NS + "title") or "")
    assert "end of the step" not in wi.to_svg()


def test_the_backward_curve_is_absolute_like_the_what_if_chart():
    from gradscope._format import human_bytes

    report, bm, *_ = _step("activations")
    root = ET.fromstring(bm.to_svg())
    title = "".join(next(root.iter(NS + "text")).itertext())
    assert "absolute" in title and f"peak {human_bytes(bm.base + bm.peak)}," in title
    start = next(e for e in root.iter(NS + "line") if e.get("class") == "start")
    assert human_bytes(bm.base) in start.findtext(NS + "title")
    ticks = [(float(e.get("y")), e.text) for e in root.iter(NS + "text") if e.get("text-anchor") == "end"]
    assert max(ticks)[1] != "0 B" and min(ticks)[1] == human_bytes(bm.base + bm.peak)  # top tick: the peak
    peak = next(e for e in root.iter(NS + "circle") if e.get("class") == "peak")
    assert abs(float(peak.get("cy")) - min(ticks)[0] + 4) < 0.11      # the peak sits on the top tick
