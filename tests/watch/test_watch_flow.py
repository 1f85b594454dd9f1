"""``gradscope.watch``: gradient flow (history, flags, update ratios, SVG), quieter warnings, repro bugs."""

from __future__ import annotations

import gc
import math
import warnings
import weakref
import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

import gradscope

SVG = "{http://www.w3.org/2000/svg}"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        self.head = nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.ones(()))          # owned by the root module directly

    def forward(self, x, head="both"):
        h = self.block(self.emb(x).relu())
        return self.head(h) * self.scale


def truth_norms(model) -> dict:
    """{module: vector_norm of the gradients of the parameters it owns directly}."""
    out = {}
    for name, module in model.named_modules():
        grads = [p.grad.flatten() for p in module.parameters(recurse=False) if p.grad is not None]
        if grads:
            out[name] = float(torch.linalg.vector_norm(torch.cat(grads)))
    return out


def test_history_equals_vector_norm_and_is_bounded():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    truths = []
    with gradscope.watch(model, history=3) as guard:
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(6, 4)).pow(2).mean().backward()
            truths.append(truth_norms(model))
            opt.step()
    assert len(guard.history) == 3                              # bounded
    for entry, truth in zip(guard.history, truths[-3:]):
        assert set(entry) == set(truth) == {"", "emb", "block.0", "block.1", "head"}
        for m in truth:
            assert math.isclose(entry[m], truth[m], rel_tol=1e-5), (m, entry[m], truth[m])


def test_vanishing_and_exploding_flags_with_user_thresholds():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    with gradscope.watch(model, vanishing=1e-6, exploding=50.0) as guard:
        x = torch.randn(3, 4)
        h = model[0](x) * 1e-12                                 # model[0] barely affects the loss
        out = model[2](model[1](h) + 1e3)                       # model[2]'s input is huge
        out.sum().backward()
    truth = truth_norms(model)
    flags = {(m, kind) for _, m, kind, _ in guard.flags}
    assert truth["0"] < 1e-6 and truth["2"] > 50 and 1e-6 < truth["1"] < 50
    assert flags == {("0", "vanishing"), ("2", "exploding")}
    with pytest.raises(gradscope.InputValueError, match="vanishing"):
        gradscope.watch(model, vanishing=-1)


def test_update_weight_ratios_with_the_optimizer():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    truth = []
    with gradscope.watch(model, optimizer=opt, ratio_every=2) as guard:
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(6, 4)).pow(2).mean().backward()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            if step % 2 == 1:                             # optimizer steps 2 and 4
                r = {}
                for name, module in model.named_modules():
                    own = [n for n, _ in module.named_parameters(prefix=name, recurse=False)]
                    own = [n[1:] if n.startswith(".") else n for n in own]
                    if own:
                        d = torch.cat([(dict(model.named_parameters())[n] - before[n]).flatten() for n in own])
                        w = torch.cat([before[n].flatten() for n in own])
                        r[name] = float(d.detach().norm() / w.norm())
                truth.append(r)
    assert len(guard.update_ratios) == 2
    for got, want in zip(guard.update_ratios, truth):
        assert set(got) == set(want)
        for m in want:
            assert math.isclose(got[m], want[m], rel_tol=1e-4)
    assert "optimizer=AdamW" in repr(guard)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks   # removed


def test_gradient_flow_svg_is_a_heat_map_of_the_history(tmp_path):
    torch.manual_seed(0)
    model = Net()
    with gradscope.watch(model, exploding=0.5) as guard:
        for _ in range(4):
            model.zero_grad()
            model(torch.randn(6, 4)).pow(2).mean().backward()
    path = tmp_path / "flow.svg"
    assert guard.flow_svg(path) == str(path)                            # a path in, the path out
    svg = guard.flow_svg()                                              # no path: the SVG text
    assert path.read_text() == svg
    root = ET.fromstring(svg)
    assert root.tag == SVG + "svg" and int(root.get("width")) >= 360 and int(root.get("height")) > 58 + 5 * 14
    cells = [r for r in root.iter(SVG + "rect") if r.get("class") == "cell"]
    assert len(cells) == 5 * 4                                          # modules x steps
    titles = [c.find(SVG + "title").text for c in cells]
    norms = guard.history
    assert f"emb, backward 1: {norms[0]['emb']:.3g}" in titles
    flagged = [c for c in cells if c.get("stroke") == "#d62728"]
    assert len(flagged) == sum(1 for e in norms for v in e.values() if v > 0.5) > 0
    fills = {c.get("fill") for c in cells}
    assert len(fills) > 3                                               # colour follows the value
    labels = [t.text for t in root.iter(SVG + "text")]
    assert "gradient flow: Net" in labels


def test_warn_mode_warns_once_per_problem_counts_and_summarises():
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 1), "b": nn.Linear(4, 1)})

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m["a"](x)                      # head b never used

    net = Two()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")                # our dedupe, not Python's
        guard = gradscope.watch(net, on_error="warn")
        for _ in range(5):
            net(torch.randn(2, 4)).sum().backward()
        during = [str(w.message) for w in record]
        assert "found none-grad x10" in repr(guard)
        guard.remove()
    assert len(during) == 1 and "m.b.weight" in during[0] and "backward 1" not in during[0]
    assert "in a backward" in during[0]
    summary = str(record[-1].message)
    assert len(record) == 2 and "summary over 5 backwards" in summary and "none-grad 10 times" in summary
    assert record[0].filename == __file__


def test_backward_that_wrote_no_grad_is_not_checked():
    class AllNone(torch.autograd.Function):           # its backward returns no gradient: torch writes no .grad
        @staticmethod
        def forward(ctx, x):
            return x * 3

        @staticmethod
        def backward(ctx, g):
            return None

    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    seen = []
    with gradscope.watch(m, on_error=seen.extend) as guard:
        AllNone.apply(m[0].weight).sum().backward()
    assert [p.grad for p in m.parameters()] == [None] * 4          # torch: no .grad written at all
    assert seen == [] and guard.backwards == 0


def test_replaced_parameter_is_watched_under_its_name():
    m = nn.Linear(4, 4)                                 # a parameter replaced between steps
    seen = []
    with gradscope.watch(m, on_error=seen.extend):
        m.weight = nn.Parameter(torch.randn(4, 4))
        m(torch.randn(2, 4)).sum().backward()
        assert seen == [] and m.weight.grad is not None
        m.weight = nn.Parameter(torch.randn(4, 4))
        (m(torch.randn(2, 4)).sum() + m.weight.mul(0).sqrt().sum()).backward()
    assert {p for f in seen if f.kind == "nonfinite-grad" for p in f.params} == {"weight"}
    assert not torch.isfinite(m.weight.grad).all()


def test_non_leaf_parameter_is_a_clear_error():
    m = nn.Linear(2, 2)                                 # a parameter that is not a leaf
    m.fr = nn.Parameter(torch.randn(2), requires_grad=False)
    m.fr[0] = m.weight.sum()
    assert not m.fr.is_leaf
    with pytest.raises(gradscope.InputValueError, match=r"'fr' is not a leaf tensor.*ignore=\['fr'\]"):
        gradscope.watch(m)
    with gradscope.watch(m, ignore=["fr"]) as guard:
        m(torch.randn(3, 2)).sum().backward()
    assert guard.checks == 1


def test_removed_guard_holds_no_parameter():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ref = weakref.ref(m[0].weight)
    guard = gradscope.watch(m, optimizer=opt)
    m(torch.randn(2, 4)).sum().backward()
    guard.remove()
    del m, opt
    gc.collect()
    assert ref() is None and "2 backwards" not in repr(guard) and "removed" in repr(guard)
    assert "4 parameters" in repr(guard)
