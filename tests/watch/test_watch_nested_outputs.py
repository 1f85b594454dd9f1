"""``graph-without-backward`` for models whose output is nested deeper than one level (a detector's list
of dicts, a dataclass of tuples). Truth from torch: the eval outputs carry a ``grad_fn`` (a graph was
built) and no backward ran; the healthy twins (the same loop under ``torch.no_grad()``, and training
steps that backward the nested outputs) stay clean.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import gradscope


class Detector(nn.Module):
    """Returns one dict per image, as torchvision detection models do in eval mode."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.boxes = nn.Linear(8, 4)
        self.scores = nn.Linear(8, 1)

    def forward(self, images):
        feats = torch.relu(self.body(images))
        return [{"boxes": self.boxes(f), "scores": self.scores(f).sigmoid()} for f in feats]


@dataclasses.dataclass
class Heads:
    logits: tuple
    extras: tuple


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        return Heads(logits=((self.a(x),),), extras=((self.b(x), "tag"),))


def _leaves(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _leaves(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _leaves(v)]
    if dataclasses.is_dataclass(out):
        return [t for f in dataclasses.fields(out) for t in _leaves(getattr(out, f.name))]
    return []


def _loop(model, no_grad=False, train_steps=2, evals=4):
    torch.manual_seed(0)
    seen, outs = [], []
    with gradscope.watch(model, on_error=seen.extend):
        for _ in range(2):
            model.train()
            for _ in range(train_steps):
                model.zero_grad()
                sum(t.float().sum() for t in _leaves(model(torch.randn(2, 8)))).backward()
            model.eval()
            for _ in range(evals):
                if no_grad:
                    with torch.no_grad():
                        outs.append(model(torch.randn(2, 8)))
                else:
                    outs.append(model(torch.randn(2, 8)))
                outs = outs[-1:]
    return seen, outs


def test_a_list_of_dicts_output_without_backward_is_reported():
    seen, outs = _loop(Detector())
    assert all(t.grad_fn is not None for t in _leaves(outs[-1]))  # torch: a graph was built
    found = [f for f in seen if f.kind == "graph-without-backward"]
    assert len(found) == 1 and "model.eval()" in found[0].message and "no_grad" in found[0].message


def test_a_dataclass_of_tuples_output_without_backward_is_reported():
    seen, outs = _loop(TwoHeads())
    assert all(t.grad_fn is not None for t in _leaves(outs[-1]))
    found = [f for f in seen if f.kind == "graph-without-backward"]
    assert len(found) == 1 and "forwards of TwoHeads" in found[0].message


def test_the_same_loops_under_no_grad_are_clean():
    for model in (Detector(), TwoHeads()):
        seen, outs = _loop(model, no_grad=True)
        assert all(t.grad_fn is None for t in _leaves(outs[-1]))
        assert seen == []


def test_nested_outputs_that_are_backwarded_are_clean():
    for model in (Detector(), TwoHeads()):
        seen, _ = _loop(model, train_steps=3, evals=0)
        assert seen == []
