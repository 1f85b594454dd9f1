"""Missed hazards, "maybe" warnings, places and reasons, messages. Truth comes from torch:
backward() raises or not, ``.grad`` is None or not after it.
"""

from __future__ import annotations

import inspect as pyinspect
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradscope
from tests.fuzz._vocab import ScaleF, Square


def _raises(loss) -> bool:
    try:
        loss.backward()
    except RuntimeError:
        return True
    return False


def _kinds(report, severity=None):
    return [f.kind for f in report.findings if severity is None or f.severity == severity]


def _line(fn, marker: str) -> str:
    lines, start = pyinspect.getsourcelines(fn)
    hits = [start + i for i, t in enumerate(lines) if t.rstrip().endswith("# " + marker)]
    assert len(hits) == 1
    return f"{os.path.basename(pyinspect.getsourcefile(fn))}:{hits[0]}"


# -- miss no hazard --------------------------------------------------------------------------------
def test_split_view_of_an_input_written_with_a_grad_requiring_value():
    # a piece of split() of a plain input, written with a grad-requiring value after mul saved it: once missed
    w = nn.Parameter(torch.randn(4))
    xi = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(4, 4)
    v = x.split(2)[0]
    loss = (v * w).sum()
    x.mul_(xi)
    r = gradscope.inspect(loss, params={"w": w})
    assert _kinds(r, "error") == ["inplace-hazard"]
    assert "is a view and its base" in r.findings[0].message
    assert _raises(loss)


@pytest.mark.parametrize("saver", ["function", "reentrant", "non-reentrant"])
def test_split_view_saved_by_custom_function_or_checkpoint(saver):
    # the same piece saved by a custom Function (once missed), and by the two checkpoint flavours
    p = nn.Parameter(torch.randn(4, 4))
    h = p * 2
    a, b = h.split(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if saver == "function":
            out = Square.apply(b)
        else:
            out = checkpoint(lambda t: t.sin() * 2, b, use_reentrant=saver == "reentrant")
    loss = out.sum()
    h.zero_()
    r = gradscope.inspect(loss, params={"p": p})
    assert _kinds(r, "error") == ["inplace-hazard"]
    assert "saved_tensors[" not in r.findings[0].message
    assert _raises(loss)


class _Body(nn.Module):
    def __init__(self, bad: bool):
        super().__init__()
        self.a, self.b, self.bad = nn.Linear(4, 4), nn.Linear(4, 4), bad

    def body(self, x):
        h = self.a(x)
        if self.bad:
            h = h.sigmoid()
            h.mul_(2)  # WRITE
        else:
            h.relu_()      # Linear -> ReLU(inplace): addmm does not save its output, safe
        return self.b(h)

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=True).sum()


@pytest.mark.parametrize("bad", [True, False], ids=["sigmoid-then-mul_", "linear-then-relu_"])
def test_inplace_inside_reentrant_checkpoint(bad):
    # an in-place write inside a reentrant checkpoint's forward: detected with trace(); without it the
    # summary lowers its promise.
    net = _Body(bad)
    x = torch.randn(2, 4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gradscope.trace(net) as tr:
            loss = net(x)
    r = gradscope.inspect(loss, model=net, trace=tr)
    untraced = gradscope.inspect(loss, model=net)
    if bad:
        assert _kinds(r) == ["inplace-hazard"] and r.findings[0].location == _line(_Body.body, "WRITE")
        assert "mul()" in r.findings[0].message and "use_reentrant=False" in r.findings[0].message
    else:
        assert r.findings == []
        assert "No findings outside 1 reentrant checkpoint region" in r.summary()
    assert [f.severity for f in untraced.findings] == ["warning"]   # a.*, b.* may be inside: listed
    assert set(untraced.findings[0].params) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert _raises(loss) == bad
    if not bad:
        assert all(p.grad is not None for p in net.parameters())


@pytest.mark.parametrize("second", [True, False], ids=["written-again", "written-once"])
def test_inplace_on_a_slice_that_hides_its_saved_result(second):
    lin = nn.Linear(3, 4)

    def forward():
        a = lin(torch.randn(2, 3))
        a[:, :2].sigmoid_()
        if second:
            a.mul_(2)  # SECOND
        return a.sum()

    with gradscope.trace(lin) as tr:
        loss = forward()
    r = gradscope.inspect(loss, model=lin, trace=tr)
    if second:
        assert _kinds(r) == ["inplace-hazard"]
        assert r.findings[0].location == _line(forward, "SECOND") and "CopySlices" in r.findings[0].message
    else:
        assert r.findings == []
    assert _raises(loss) == second


# -- fewer "maybe" warnings -----------------------------------------------------------------------
def _unused_severity(build):
    lin, other = nn.Linear(3, 3), nn.Linear(3, 3)
    model = nn.ModuleDict({"lin": lin, "other": other})
    loss = build(lin, torch.randn(2, 3)).sum()
    r = gradscope.inspect(loss, model=model)
    found = [(f.severity, set(f.params)) for f in r.findings]
    loss.backward()
    assert other.weight.grad is None and lin.weight.grad is not None    # torch's truth
    return found


def test_custom_function_hides_no_parameter():
    assert _unused_severity(lambda lin, x: ScaleF.apply(lin(x))) == [
        ("error", {"other.weight", "other.bias"})]


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_full_backward_hook_wrapper_hides_no_parameter():
    def build(lin, x):
        lin.register_full_backward_hook(lambda m, gi, go: None)
        return lin(x)
    assert _unused_severity(build) == [("error", {"other.weight", "other.bias"})]


def test_compiled_region_hides_no_parameter():
    def build(lin, x):
        return torch.compile(lin, backend="aot_eager")(x)
    assert _unused_severity(build) == [("error", {"other.weight", "other.bias"})]


# -- right place, right reason --------------------------------------------------------------------
class _Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.mu, self.sig, self.enc, self.head = (nn.Linear(3, 2), nn.Linear(3, 2), nn.Linear(3, 3),
                                                  nn.Linear(3, 1))
        self.logged = []

    def forward(self, x):
        d = torch.distributions.Normal(self.mu(x), self.sig(x).exp())    # validates its arguments
        a = d.sample()  # SAMPLE
        feat = self.enc(x)
        self.logged.append((feat > 0).float().mean().item())            # a logged comparison
        h = feat.detach()  # DETACH
        return self.head(h).sum() + a.sum()


def test_blame_the_event_that_severed_the_path():
    m = _Policy()
    with gradscope.trace(m) as tr:
        loss = m(torch.randn(4, 3))
    r = gradscope.inspect(loss, model=m, trace=tr)
    where = {frozenset(f.params): f.location for f in r.findings}
    assert where == {frozenset({"enc.weight", "enc.bias"}): _line(_Policy.forward, "DETACH"),
                     frozenset({"mu.weight", "mu.bias", "sig.weight", "sig.bias"}):
                         _line(_Policy.forward, "SAMPLE")}
    loss.backward()
    assert {n for n, p in m.named_parameters() if p.grad is None} == {
        "enc.weight", "enc.bias", "mu.weight", "mu.bias", "sig.weight", "sig.bias"}


def test_never_called_module_is_the_reason_not_the_optimizer():
    m = nn.ModuleDict({"a": nn.Linear(3, 1), "unused": nn.Linear(3, 1)})
    opt = torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.1)
    (m["a"](torch.randn(2, 3)).sum() + m["unused"](torch.randn(2, 3)).sum()).backward()
    with gradscope.trace(m) as tr:
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = m["a"](torch.randn(2, 3)).sum()
        torch.optim.Adam(m.parameters()).step()     # state created under no_grad after the forward
    r = gradscope.inspect(loss, model=m, trace=tr)
    assert [f.kind for f in r.findings] == ["unused-parameter"]
    assert "module unused was never called" in r.findings[0].message
    assert "find_unused_parameters=True" in r.findings[0].message    # legitimately skipped: DDP hint
    loss.backward()
    assert m["unused"].weight.grad is None


def test_inplace_writes_inside_torch_functions_get_the_users_line():
    lin = nn.Linear(3, 4)

    def drop():
        h = torch.sigmoid(lin(torch.randn(2, 3)))
        return F.dropout(h, 0.5, training=True, inplace=True).sum()  # DROPOUT

    emb = nn.Embedding(10, 4, max_norm=1.0)

    def renorm():
        sq = emb.weight ** 2
        return sq.sum() + emb(torch.tensor([1, 2])).sum()  # RENORM

    for fn, model, marker, words in ((drop, lin, "DROPOUT", "inplace=False"),
                                     (renorm, emb, "RENORM", "max_norm")):
        with gradscope.trace(model) as tr:
            loss = fn()
        r = gradscope.inspect(loss, model=model, trace=tr)
        assert _kinds(r) == ["inplace-hazard"] and r.findings[0].location == _line(fn, marker)
        assert words in r.findings[0].message
        assert _raises(loss)


# -- messages a user can act on -------------------------------------------------------------------
def test_no_out_of_place_function_that_does_not_exist_and_user_words():
    enc = nn.Sequential(nn.Linear(3, 4), nn.Sigmoid(), nn.Linear(4, 1))
    with gradscope.trace(enc) as tr:
        h = enc[1](enc[0](torch.randn(2, 3)))
        out = enc[2](h)
        h.zero_()
    r = gradscope.inspect(out.sum(), model=enc, trace=tr)
    msg = r.findings[0].message
    assert "torch.zeros_like(x)" in msg and "zero()" not in msg
    assert "its own output" in msg and "'result'" not in msg
    assert not hasattr(torch.Tensor, "zero")
    assert _raises(out.sum())


def test_write_inside_optimizer_step_says_backward_before_step():
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(2, 3)).sum().backward()
    with gradscope.trace(m) as tr:
        loss = m(torch.randn(2, 3)).sum()
        opt.step()
    r = gradscope.inspect(loss, model=m, trace=tr)
    msg = r.findings[0].message
    assert "backward() before optimizer.step()" in msg and "addcmul" not in msg and "add()" not in msg
    assert "the parameter 1.weight" in msg and "'mat2'" not in msg
    assert _raises(loss)


def test_freed_graph_is_an_error_with_the_step_boundary_fix():
    rnn = nn.RNNCell(3, 4)
    h = torch.zeros(1, 4)
    h = rnn(torch.randn(1, 3), h)
    h.sum().backward()                  # step 1
    loss = rnn(torch.randn(1, 3), h).sum()     # step 2 carries h (and its freed graph) over
    r = gradscope.inspect(loss, model=rnn)
    f = [f for f in r.findings if f.kind == "freed-graph"]
    assert f and f[0].severity == "error" and ".detach() it at the step boundary" in f[0].message
    assert _raises(loss)


def _lin_then_head(middle):
    """``head(middle(lin, x)).sum()`` traced over ``{lin, head}``: ``(lin, head, loss, report)``."""
    lin, head = nn.Linear(3, 3), nn.Linear(3, 1)
    model = nn.ModuleDict({"lin": lin, "head": head})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gradscope.trace(model) as tr:
            loss = head(middle(lin, torch.randn(2, 3))).sum()
    return lin, head, loss, gradscope.inspect(loss, model=model, trace=tr)


def test_reentrant_checkpoint_without_grad_inputs_is_the_cause():
    lin, head, loss, r = _lin_then_head(lambda lin, x: checkpoint(lin, x, use_reentrant=True))
    assert len(r.findings) == 1 and "inputs do not require grad" in r.findings[0].message
    assert set(r.findings[0].params) == {"lin.weight", "lin.bias"}
    assert "use the module in forward" not in r.findings[0].message.lower()
    loss.backward()
    assert lin.weight.grad is None and head.weight.grad is not None


def test_torch_tensor_copy_is_named_as_a_copy():
    lin, _, loss, r = _lin_then_head(lambda lin, x: torch.tensor(lin(x)))
    assert "torch.tensor()" in r.findings[0].message and "argmax" not in r.findings[0].message
    loss.backward()
    assert lin.weight.grad is None


def test_untraced_one_detach_over_several_modules_is_one_finding_without_ddp_hint():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    loss = model[2](model[1](model[0](torch.randn(2, 3))).detach()).sum()
    r = gradscope.inspect(loss, model=model)
    assert len(r.findings) == 1 and len(r.findings[0].params) == 4
    assert "find_unused_parameters" not in r.findings[0].message
    loss.backward()
    assert {n for n, p in model.named_parameters() if p.grad is None} == set(r.findings[0].params)
