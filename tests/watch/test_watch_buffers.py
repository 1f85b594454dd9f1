"""``carried-graph`` for graphs kept in module buffers and attributes by an op, not an assignment: a buffer
written in place with a graph-carrying value outside ``no_grad`` (``index_copy_``, ``buf[idx] = v``,
``copy_``) and a table computed from parameters on the first call and cached on the module. Truth: torch
itself raises "backward through the graph a second time" at the next step; under watch the error names
the buffer or attribute and the line of the module's code that wrote it. The healthy twins (the same
writes under ``torch.no_grad()`` or of a detached value) train for three steps and stay clean.
"""

from __future__ import annotations

import inspect as pyinspect
import os

import pytest
import torch
from torch import nn

import gradscope


def _line(cls, marker: str) -> str:
    lines, start = pyinspect.getsourcelines(cls)
    hits = [start + i for i, t in enumerate(lines) if t.rstrip().endswith("# " + marker)]
    assert len(hits) == 1, (marker, hits)
    return f"{os.path.basename(pyinspect.getsourcefile(cls))}:{hits[0]}"


class Queue(nn.Module):
    """A MoCo-style memory bank: this step's features go into a buffer queue."""

    def __init__(self, safe=False):
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.safe = safe
        self.register_buffer("bank", torch.zeros(8, 4))
        self.ptr = 0

    def forward(self, x):
        feats = self.enc(x)
        idx = torch.arange(self.ptr, self.ptr + 2) % 8
        self.ptr += 2
        if self.safe:
            with torch.no_grad():
                self.bank.index_copy_(0, idx, feats)
        else:
            self.bank.index_copy_(0, idx, feats)  # WRITE
        return (feats @ self.bank.t()).logsumexp(-1).mean()


class Slots(nn.Module):
    """A running store written item by item."""

    def __init__(self, safe=False):
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.safe = safe
        self.register_buffer("store", torch.zeros(4, 4))

    def forward(self, x):
        feats = self.enc(x)
        self.store[:2] = feats.detach() if self.safe else feats  # WRITE
        return feats.sum() + self.store.sum()


class Mirror(nn.Module):
    """An EMA-like copy into a buffer slice with copy_."""

    def __init__(self, safe=False):
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.safe = safe
        self.register_buffer("shadow", torch.zeros(6, 4))

    def forward(self, x):
        feats = self.enc(x)
        self.shadow[:2].copy_(feats.detach() if self.safe else feats)  # WRITE
        return (feats * self.shadow[2:4]).sum() + self.shadow.sum()


class CachedTable(nn.Module):
    """A table computed from the weights on the first call and kept."""

    def __init__(self, safe=False):
        super().__init__()
        self.w = nn.Linear(4, 4)
        self.safe = safe
        self.table = None

    def forward(self, x):
        if self.table is None or self.safe:
            self.table = self.w.weight.t() * 2  # WRITE
        return (self.w(x) @ self.table).sum()


CASES = [(Queue, "buffer 'bank'"), (Slots, "buffer 'store'"), (Mirror, "buffer 'shadow'"),
         (CachedTable, "attribute 'table'")]  # fmt: skip


def _train(model, steps=3):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(2, 4)).backward()
        opt.step()


@pytest.mark.parametrize("cls,what", CASES, ids=[c[0].__name__ for c in CASES])
def test_a_graph_kept_by_an_op_names_the_buffer_and_the_line_that_wrote_it(cls, what):
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _train(cls())  # torch's own error, unwatched
    model, seen = cls(), []
    with pytest.raises(gradscope.GradientError) as exc, gradscope.watch(model, on_error=seen.extend):
        _train(model)
    msg = str(exc.value)
    assert what in msg and f"at {_line(cls, 'WRITE')}," in msg, msg
    assert "freed" in msg


@pytest.mark.parametrize("cls", [c[0] for c in CASES], ids=[c[0].__name__ for c in CASES])
def test_the_same_writes_without_a_graph_are_clean(cls):
    model, seen = cls(safe=True), []
    with gradscope.watch(model, on_error=seen.extend):
        _train(model)  # torch: no error
    assert seen == []
