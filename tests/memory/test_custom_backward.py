"""A custom autograd.Function's backward, measured on fake tensors by default (memory/kernels/fake.py NOTE
[custom backwards on fake tensors]) or on real random tensors with ``run_custom=True``, against
torch.profiler's own measurement of one training step (tests/_memtruth.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import gradscope
from gradscope.memory.kernels import fake
from tests._memtruth import measure

FAKE = "fake tensors"
REAL = "real random tensors (run_custom=True)"
CALLS: list = []


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADSCOPE_CACHE", str(tmp_path / "cache"))


class BloomGeLU(torch.autograd.Function):
    """BLOOM's GeLUFunction: the backward recomputes tanh and keeps several activation-sized temporaries."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        th = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - th * th) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + th)
        return ff * g


class TwoOut(torch.autograd.Function):
    """Two outputs; the backward makes ``ga * x.cos()`` and ``gb * x.sin()`` before it returns."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin(), x.cos()

    @staticmethod
    def backward(ctx, ga, gb):
        (x,) = ctx.saved_tensors
        return ga * x.cos() - gb * x.sin()


def _helper(x, g):
    return torch.tanh(x) * g


class CallsHelper(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _helper(x, g) + x.exp() * g


class ReadsValue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.abs().max().item()


class Branches(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if (x > 0).all():
            return g * 2
        return g * x.exp()


class Counts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        CALLS.append("backward")
        return g * 2


class Prints(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        print("in backward")
        return g * 2


class Stashes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.x = x
        return x.exp()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.x.exp()


def _linear_then(fn, n_in=64, n_out=256, batch=64):
    m, x = nn.Linear(n_in, n_out), torch.randn(batch, n_in)
    return m, x, lambda: fn(m(x))


def _truth(build, **kw):
    torch.manual_seed(0)
    model, x, f = build()
    gradscope.inspect(f(), model=model).backward_memory(**kw)  # measured here, outside the profiled step
    return measure(lambda: (f(), model), before=[x], inspect=lambda loss, m: gradscope.inspect(loss, model=m),
                   predict=lambda r, _: r.backward_memory(**kw))


BUILDS = {
    "BLOOM GeLU": lambda: _linear_then(lambda y: BloomGeLU.apply(y).sum()),
    "two outputs": lambda: _linear_then(lambda y: sum(t.sum() for t in TwoOut.apply(y * 2.0))),
    "two outputs, one unused (zeros made for it)": lambda: _linear_then(lambda y: TwoOut.apply(y * 2.0)[0].sum()),
    "a Python helper": lambda: _linear_then(lambda y: CallsHelper.apply(y).sum()),
}


@pytest.mark.parametrize("name", list(BUILDS))
@pytest.mark.parametrize("run_custom", [False, True])
def test_custom_backward_peak_matches_the_profiler(name, run_custom):
    truth = _truth(BUILDS[name], run_custom=run_custom)
    bm = truth.prediction
    assert abs(bm.peak - truth.peak) <= 0.01 * truth.peak, (bm.peak, truth.peak)
    assert bm.innode_unknown == {} and bm.unmodelled == []
    assert list(bm.custom_runs.values()) == [REAL if run_custom else FAKE]
    assert bm.peak - max(bm.workspace.values()) < 0.99 * truth.peak  # the temporaries made the peak
    assert f"run on {REAL if run_custom else FAKE}" in str(bm)


def test_fake_tensors_are_the_default_and_print_says_so():
    torch.manual_seed(0)
    model, _, f = BUILDS["BLOOM GeLU"]()
    bm = gradscope.inspect(f(), model=model).backward_memory()
    assert bm.custom_runs == {bm.peak_node: FAKE}
    text = str(bm)
    assert ("custom autograd.Function backward run on fake tensors to measure its in-node memory: "
            "BloomGeLUBackward (1).") in text
    assert "lower bound" not in text


UNSAFE = {
    "reads a value": (ReadsValue, "it reads tensor values (.item(), a tensor in an if"),
    "branches on a value": (Branches, "it reads tensor values"),
    "appends to a global list": (Counts, "it reads 'CALLS' (a list), which may hold state"),
    "prints": (Prints, "it calls print()"),
    "a tensor kept on ctx": (Stashes, "reads ctx.x, which the graph does not record"),
}


@pytest.mark.parametrize("name", list(UNSAFE))
def test_a_backward_that_is_not_pure_tensor_code_is_a_labelled_lower_bound(name, capsys):
    cls, why = UNSAFE[name]
    CALLS.clear()
    torch.manual_seed(0)
    model, x, f = _linear_then(cls.apply)
    loss = f().sum()
    bm = gradscope.inspect(loss, model=model).backward_memory()
    assert len(bm.innode_unknown) == 1 and why in next(iter(bm.innode_unknown.values()))
    assert bm.custom_runs == {} and list(bm.innode_unknown) == bm.unmodelled
    assert "lower bounds" in str(bm)
    assert CALLS == [] and "in backward" not in capsys.readouterr().out  # nothing of it ran
    loss.backward()  # torch runs it: the side effect is the user's own
    assert (CALLS == ["backward"]) == (cls is Counts)


def test_fake_run_allocates_no_real_memory():
    """The backward of a 1 MiB activation, run on fake tensors under the caller's profiler: no allocation
    of c10's CPU allocator comes near its size (what it would allocate for real is 5 MiB)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model, _, f = _linear_then(lambda y: BloomGeLU.apply(y).sum(), 256, 1024, 256)
    loss = f()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        bm = gradscope.inspect(loss, model=model).backward_memory()
    assert bm.custom_runs == {bm.peak_node: FAKE}
    assert max(bm.workspace.values()) >= 4 * 1024 * 1024
    sizes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        if n.typed[0] == _EventType.Allocation:
            sizes.append(int(n.typed[1].alloc_size))
        stack.extend(n.children)
    assert sizes and max(sizes) < 256 * 1024, max(sizes)


def test_an_edited_backward_is_measured_again(monkeypatch):
    torch.manual_seed(0)
    model, _, f = _linear_then(lambda y: CallsHelper.apply(y).sum())
    before = gradscope.inspect(f(), model=model).backward_memory()

    def more(ctx, g):  # one more activation-sized temporary alive at once
        (x,) = ctx.saved_tensors
        a, b, c = x.exp(), x.sin(), x.cos()
        return a * b * c * g

    monkeypatch.setattr(CallsHelper, "backward", staticmethod(more))
    after = gradscope.inspect(f(), model=model).backward_memory()
    node = next(iter(after.custom_runs))
    assert after.workspace[node] > before.workspace[node]


def test_safety_is_decided_from_the_code_before_it_runs():
    assert fake.unsafe_reason(BloomGeLU) is None
    assert fake.unsafe_reason(CallsHelper) is None  # a helper function of pure tensor code
    assert fake.unsafe_reason(Counts) == "it reads 'CALLS' (a list), which may hold state"
    assert fake.unsafe_reason(Prints) == "it calls print()"

    class Writes(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            global _LAST
            _LAST = g
            return g

    class Collective(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            torch.distributed.all_reduce(g)
            return g

    assert fake.unsafe_reason(Writes) == "it writes the global '_LAST'"
    assert fake.unsafe_reason(Collective) == "it uses torch.distributed"
