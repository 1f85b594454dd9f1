"""``gradscope.watch`` across steps: carried-graph, retained-graph, graph-without-backward; torch is the truth."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import gradscope
from gradscope._format import human_bytes


class RNN(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.cell = nn.RNNCell(3, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x, h):
        h = self.cell(x, h)
        return self.head(h), h


def _line(marker: str) -> str:
    """``test_watch_steps.py:N`` of the line holding ``marker`` in this file."""
    with open(__file__, encoding="utf-8") as f:
        for i, text in enumerate(f, 1):
            if marker in text and "_line(" not in text:
                return f"test_watch_steps.py:{i}"
    raise AssertionError(marker)


def saved_bytes(fn) -> int:
    """Truth for "saved bytes": run ``fn`` under identity pack hooks and sum the distinct storages saved
    that are not parameters and are still alive afterwards."""
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (packed.append(t), t)[1], lambda t: t):
        out = fn()
    seen, total = set(), 0
    for t in packed:
        if t._base is not None and isinstance(t._base, nn.Parameter) or isinstance(t, nn.Parameter):
            continue                               # a parameter (or its .t() view): not graph memory
        if t.dim() == 0 and t.dtype in (torch.float64, torch.int64):
            continue
        ptr = t.untyped_storage()._cdata
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return out, total


def test_carried_hidden_state_caught_before_torchs_error():
    torch.manual_seed(0)
    model = RNN()
    h = torch.zeros(2, 8)                          # truth: torch's own error without the guard
    out, h = model(torch.randn(2, 3), h)
    out.sum().backward()
    out, h = model(torch.randn(2, 3), h)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()

    h = torch.zeros(2, 8)
    with gradscope.watch(model) as guard:
        out, h = model(torch.randn(2, 3), h)
        out.sum().backward()
        with pytest.raises(gradscope.GradientError) as exc:
            out, h = model(torch.randn(2, 3), h)   # carried: step 2
    (f,) = exc.value.findings
    assert (f.kind, f.severity) == ("carried-graph", "error")
    assert set(f.params) == {n for n, _ in model.cell.named_parameters(prefix="cell")}
    assert f.location == _line("# carried: step 2")
    assert "The input 'h' of RNN.forward" in f.message and "`h = h.detach()`" in f.message
    assert "Trying to backward through the graph a second time" in f.message
    assert guard.counts == {"carried-graph": 1}


def test_carried_state_explains_torchs_error_when_not_raising():
    torch.manual_seed(0)
    model = RNN()
    seen = []
    h = torch.zeros(2, 8)
    with gradscope.watch(model, on_error=seen.extend):
        out, h = model(torch.randn(2, 3), h)
        out.sum().backward()
        out, h = model(torch.randn(2, 3), h)
        assert [f.kind for f in seen] == ["carried-graph"]
        with pytest.raises(gradscope.GradientError, match="backward through the graph a second time") as exc:
            out.sum().backward()
    assert isinstance(exc.value, RuntimeError) and exc.value.findings[0].kind == "carried-graph"


def test_carried_with_retain_graph_grows_like_the_saved_bytes():
    torch.manual_seed(0)
    model = RNN()
    seen = []
    h0 = torch.zeros(2, 8)
    xs = [torch.randn(2, 3) for _ in range(4)]
    # truth: what one step's cell saves (pack hooks, an independent mechanism), less the previous hidden
    # state it saves too (that is the previous step's output, already counted there)
    h_prev = torch.ones(2, 8)
    _, one_step = saved_bytes(lambda: model.cell(xs[0], h_prev))
    per_step, h0_bytes = one_step - h_prev.untyped_storage().nbytes(), h0.untyped_storage().nbytes()
    h = h0
    with gradscope.watch(model, on_error=seen.extend):
        for x in xs:
            out, h = model(x, h)
            out.sum().backward(retain_graph=True)
    carried = [f for f in seen if f.kind == "carried-graph"]
    assert len(carried) == 3                       # steps 2, 3 and 4, each naming the growing graph
    held = [int(re.search(r"keeps (\d+) B of saved tensors", f.message).group(1)) for f in carried]
    assert held == [k * per_step + h0_bytes for k in (1, 2, 3)]   # step N keeps N-1 steps (+ h0)
    assert "retain_graph=True" in carried[0].message and "grows every step" in carried[0].message
    assert not [f for f in seen if f.kind == "retained-graph"]    # the carried finding already says it


def test_total_loss_plus_equals_is_a_retained_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    total_loss = 0
    with gradscope.watch(model, on_error=seen.extend):
        for _ in range(5):
            opt.zero_grad()
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            opt.step()
            total_loss += loss                     # keeps every step's graph
    retained = [f for f in seen if f.kind == "retained-graph"]
    assert len(retained) == 2                      # first seen, then again once the count has doubled
    f = retained[-1]
    assert f.severity == "warning" and "'total_loss'" in f.message and ".item()" in f.message
    # truth: the nodes reachable from total_loss that belong to the earlier forwards
    stack, nodes = [total_loss.grad_fn], set()
    while stack:
        n = stack.pop()
        if n not in nodes:
            nodes.add(n)
            stack.extend(m for m, _ in n.next_functions if m is not None)
    forward_nodes = [n for n in nodes if type(n).__name__ not in ("AccumulateGrad",)]
    n_reported = int(re.search(r"(\d+) autograd nodes", f.message).group(1))
    held_forwards = int(re.search(r"graphs of (\d+) forwards", f.message).group(1))
    assert held_forwards >= 2 and n_reported <= len(forward_nodes)
    assert n_reported == held_forwards * 5      # Linear: T+Addmm, Tanh, Linear: T+Addmm per forward
    assert not [f for f in seen if f.kind != "retained-graph"]


def test_outputs_appended_without_backward_keep_saved_bytes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    seen = []
    outputs, truth = [], []
    with gradscope.watch(model, on_error=seen.extend) as guard:
        for _step in range(5):
            model.zero_grad()
            model(torch.randn(4, 16)).sum().backward()
            out, b = saved_bytes(lambda: model(torch.randn(8, 16)))
            truth.append(b)
            outputs.append(out)                    # never backwarded, kept: graph and saved tensors live
        without = [f for f in seen if f.kind == "graph-without-backward"]
        retained = [f for f in seen if f.kind == "retained-graph"]
    assert len(without) == 1 and "no_grad" in without[0].message and "'outputs'" in without[0].message
    assert retained and "the list 'outputs'" in retained[-1].message
    # truth: the saved storages of the kept graphs (pack hooks), for the forwards the finding counts
    kept = retained[-1].message
    n = int(re.search(r"graphs of (\d+) forwards", kept).group(1))
    assert n >= 2 and f"{human_bytes(sum(truth[:n]))} of saved tensors" in kept, (kept, truth)
    assert guard.counts["retained-graph"] == len(retained)


def test_eval_without_no_grad_reported_once_per_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    seen = []
    with gradscope.watch(model, on_error=seen.extend):
        for epoch in range(2):
            model.train()
            for _ in range(2):
                model.zero_grad()
                model(torch.randn(8, 16)).pow(2).mean().backward()
            model.eval()
            scores = []
            for _ in range(6):
                _, per_forward = saved_bytes(lambda: model(torch.randn(8, 16)))   # eval forward
                scores.append(_.mean().item())
            assert len([f for f in seen if f.kind == "graph-without-backward"]) == min(epoch, 1)
        model.train()
        model.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
    found = [f for f in seen if f.kind == "graph-without-backward"]
    assert len(found) == 1 and found[0].severity == "warning"     # once per loop: not per batch or epoch
    assert "6 forwards of Sequential in model.eval() mode" in found[0].message
    assert f"about {human_bytes(per_forward)} of saved tensors" in found[0].message
    assert found[0].location == _line("# eval forward")
    assert [f.kind for f in seen] == ["graph-without-backward"]


def test_eval_pending_at_remove_is_reported_there():
    model = nn.Linear(4, 1)
    seen = []
    guard = gradscope.watch(model, on_error=seen.extend)
    model.eval()
    outs = [model(torch.randn(2, 4)) for _ in range(3)]
    assert seen == []
    guard.remove()
    assert [f.kind for f in seen] == ["graph-without-backward"] and "3 forwards" in seen[0].message
    assert "held by" in seen[0].message and "'outs'" in seen[0].message
    del outs


# -- healthy loops: nothing may be reported (on_error="raise") --------------------------------------------

def test_healthy_tbptt_with_detach_and_lstm_state_tuple():
    torch.manual_seed(0)
    lstm, head = nn.LSTM(3, 8, batch_first=True), nn.Linear(8, 1)
    model = nn.ModuleDict({"lstm": lstm, "head": head})

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x, state):
            out, state = self.m["lstm"](x, state)
            return self.m["head"](out), state

    net = Seq()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    state = None
    with gradscope.watch(net) as guard:
        for _ in range(5):
            out, state = net(torch.randn(2, 4, 3), state)
            opt.zero_grad()
            out.pow(2).mean().backward()
            opt.step()
            state = tuple(s.detach() for s in state)     # truncated BPTT done right
    assert guard.checks == 5 and guard.counts == {}


def test_healthy_gan_alternation_with_two_guards():
    torch.manual_seed(0)
    G, D = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), nn.Sequential(nn.Linear(4, 8),
                                                                                     nn.ReLU(), nn.Linear(8, 1))
    og, od = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    bce = nn.BCEWithLogitsLoss()
    with gradscope.watch(G) as gg, gradscope.watch(D) as gd:
        for _ in range(4):
            real, z = torch.randn(8, 4), torch.randn(8, 4)
            fake = G(z)
            od.zero_grad()
            (bce(D(real), torch.ones(8, 1)) + bce(D(fake.detach()), torch.zeros(8, 1))).backward()
            od.step()
            og.zero_grad()
            bce(D(fake), torch.ones(8, 1)).backward()    # reaches D too: D's guard sees this backward
            og.step()
    assert gg.counts == {} and gd.counts == {} and gg.checks == 4 and gd.checks == 8


def test_healthy_accumulation_multi_loss_and_no_grad_eval():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prev = None
    with gradscope.watch(model, accumulate=4) as guard:
        for _step in range(3):
            opt.zero_grad()
            for _ in range(4):                             # gradient accumulation
                loss = model(torch.randn(2, 4)).pow(2).mean() / 4
                loss.backward()
            opt.step()
            prev = loss                                    # kept one step (logging), then replaced
            model.eval()
            with torch.no_grad():                          # evaluation done right
                _ = [model(torch.randn(2, 4)) for _ in range(3)]
            model.train()
        out = model(torch.randn(2, 4))                     # two losses from one forward
        out[:, 0].sum().backward(retain_graph=True)
        out[:, 1].sum().backward()
        a, b = model(torch.randn(2, 4)), model(torch.randn(2, 4))   # two forwards, one backward each
        a.sum().backward()
        b.sum().backward()
    assert guard.counts == {} and prev is not None


def test_graphs_false_turns_the_cross_step_checks_off():
    model = RNN()
    seen = []
    h = torch.zeros(2, 8)
    with gradscope.watch(model, on_error=seen.extend, graphs=False) as guard:
        out, h = model(torch.randn(2, 3), h)
        out.sum().backward(retain_graph=True)
        out, h = model(torch.randn(2, 3), h)
        out.sum().backward(retain_graph=True)
    assert seen == [] and "graphs=False" in repr(guard)


def test_graph_findings_go_out_with_the_check_of_the_same_backward():
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, x):
            return self.a(x)                       # b never used

    model = Heads()
    with gradscope.watch(model) as guard:
        model.eval()
        for _ in range(3):
            model(torch.randn(2, 4))               # no no_grad
        model.train()
        with pytest.raises(gradscope.GradientError) as exc, \
                pytest.warns(RuntimeWarning, match="graph-without-backward") as said:
            model(torch.randn(2, 4)).sum().backward()
    kinds = [f.kind for f in exc.value.findings]
    assert kinds == ["none-grad", "none-grad"]         # the error carries the errors; the warning is warned
    assert "graph-without-backward" not in str(exc.value) and len(said) == 1
    assert guard.counts == {"none-grad": 2, "graph-without-backward": 1}
