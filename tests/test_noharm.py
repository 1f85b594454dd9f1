"""No-harm guarantees: inspecting a graph changes nothing torch can observe.

Each test compares against torch itself: tensor versions, forward call counts, gradient bits, hook
registries, and weak references to activations after the user drops the loss. Deep-graph freeing runs
in subprocesses (a failure there is a segfault that would kill pytest).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

import gradscope


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.note = "kept on ctx"
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.norm(F.gelu(self.lin(x)))


class Net(nn.Module):
    """Every kind of node inspect reads: plain ops, checkpoint (both flavours), a custom Function,
    in-place ops (safe ones), dropout, an embedding, an unused head."""

    def __init__(self, d=8):
        super().__init__()
        self.emb = nn.Embedding(10, d)
        self.a, self.b, self.c = Block(d), Block(d), Block(d)
        self.head = nn.Linear(d, 3)
        self.unused = nn.Linear(d, 3)

    def forward(self, idx):
        h = self.emb(idx)
        h = checkpoint(self.a, h, use_reentrant=False)
        h = checkpoint(self.b, h, use_reentrant=True)
        h = self.c(h)
        h = Square.apply(h)
        h = F.dropout(h, 0.1, True)
        h = h * 2
        h.add_(1)          # safe in-place: mul saved only the scalar
        return self.head(torch.relu_(h.clone()))


def _run(inspect: bool, seed: int = 0):
    torch.manual_seed(seed)
    net = Net()
    idx = torch.randint(0, 10, (4, 5))
    loss = net(idx).pow(2).mean()
    report = gradscope.inspect(loss, model=net) if inspect else None
    loss.backward()
    return net, report


def test_versions_unchanged_by_inspect_including_stale_slots():
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    h = torch.sigmoid(lin(x))
    s = Square.apply(h)
    hazard = torch.exp(h)
    h.mul_(2)               # stale: sigmoid's and exp's saved outputs, Square's saved input
    s.add_(1)
    loss = (hazard.sum() + s.sum())
    tensors = [x, h, s, hazard, loss, *lin.parameters()]
    before = [t._version for t in tensors]
    report = gradscope.inspect(loss, model=lin)
    assert [t._version for t in tensors] == before
    assert any(f.kind == "inplace-hazard" for f in report.findings)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_forward_is_never_rerun(reentrant):
    blk = Block()
    x = torch.randn(2, 8, requires_grad=True)
    loss = checkpoint(blk, x, use_reentrant=reentrant).sum()
    assert blk.calls == 1
    report = gradscope.inspect(loss, model=blk)
    report.summary()
    report.to_json()
    assert blk.calls == 1, "inspect() re-ran the checkpointed forward"
    loss.backward()
    assert blk.calls == 2  # torch's own recomputation, once


def test_gradients_bit_identical_with_and_without_inspect():
    base, _ = _run(inspect=False)
    net, report = _run(inspect=True)
    assert report is not None
    for (name, p), (_, q) in zip(net.named_parameters(), base.named_parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            assert torch.equal(p.grad.view(torch.int32), q.grad.view(torch.int32)), name


def _hook_state(net, tensors):
    from torch.nn.modules import module as m
    globals_ = [len(getattr(m, n)) for n in dir(m) if n.startswith("_global_") and n.endswith("hooks")]
    per_module = [(len(mod._forward_hooks), len(mod._forward_pre_hooks), len(mod._backward_hooks),
                   len(mod._backward_pre_hooks), len(mod._state_dict_hooks)) for mod in net.modules()]
    per_tensor = [(t._backward_hooks, getattr(t, "_post_accumulate_grad_hooks", None)) for t in tensors]
    return {
        "global_module_hooks": globals_,
        "module_hooks": per_module,
        "tensor_hooks": per_tensor,
        "saved_tensors_hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
        "torch_function_modes": torch._C._len_torch_function_stack(),
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "grad_enabled": torch.is_grad_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
    }


def test_no_hook_left_installed_and_no_node_metadata_written():
    torch.manual_seed(0)
    net = Net()
    loss = net(torch.randint(0, 10, (4, 5))).sum()
    tensors = list(net.parameters()) + [loss]
    before = _hook_state(net, tensors)
    report = gradscope.inspect(loss, model=net)
    report.summary()
    assert _hook_state(net, tensors) == before
    # no node was tagged: every reachable node's metadata dict is still empty
    seen, stack = set(), [loss.grad_fn]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        assert n.metadata == {}, n.name()
        stack.extend(c for c, _ in n.next_functions if c is not None)
    del seen, stack, n
    loss.backward()   # and backward fires nothing of ours: grads as usual
    assert net.head.weight.grad is not None and net.unused.weight.grad is None


def _activations_die(build, keep_report=True):
    """``build()`` returns (loss, [activation tensors], model); True when all activations die."""
    loss, acts, model = build()
    refs = [weakref.ref(a) for a in acts]
    storages = [StorageWeakRef(a.untyped_storage()) for a in acts]
    report = gradscope.inspect(loss, model=model)
    assert report.saved_bytes > 0
    del loss, acts
    if not keep_report:
        del report
    from gradscope.walk.release import pending
    deadline = time.time() + 10
    while pending() and time.time() < deadline:
        time.sleep(0.02)
    gc.collect()
    return all(r() is None for r in refs) and all(s.expired() for s in storages)


def _small():
    torch.manual_seed(0)
    net = Net()
    h = net.emb(torch.randint(0, 10, (4, 5)))
    a = torch.sigmoid(h)
    b = Square.apply(a)
    loss = net.head(b).sum()
    return loss, [h, a, b], net


def _hazard():
    lin = nn.Linear(4, 4)
    a = torch.sigmoid(lin(torch.randn(3, 4)))
    b = torch.exp(a)
    a.mul_(2)                      # stale slot: reading it raises inside inspect
    return (a.sum() + b.sum()), [a, b], lin


def _deep():
    w = nn.Linear(4, 4)
    h = w(torch.randn(2, 4))
    first = h
    for _ in range(12_000):        # past the deep-graph threshold: the release path holds nodes
        h = torch.sin(h)
    return h.sum(), [first, h], w


@pytest.mark.parametrize("build", [_small, _hazard, _deep], ids=["small", "hazard", "deep"])
@pytest.mark.parametrize("keep_report", [True, False], ids=["report-kept", "report-dropped"])
def test_no_activation_kept_alive_after_loss_dropped(build, keep_report):
    assert _activations_die(build, keep_report)


# -- deep chains, in subprocesses ---------------------------------------------------------------
_CHAIN = """
x = torch.randn(4, requires_grad=True)
y = x
mid = None
for i in range(N):
    y = y * 1.0001
    if i == N // 2:
        mid = y
loss = y.sum()
report = gradscope.inspect(loss, params={"x": x})
assert report.graph.number_of_nodes() == N + 2, report.graph.number_of_nodes()
assert not report.errors
"""

_RENDER = """
out = os.path.join(TMP, "deep.dot")
report.render(out)                 # auto-collapsed above the node limit
text = open(out).read()
assert text.count("->") < 1000, text.count("->")
"""

_SCENARIOS = {
    "drop-loss-mid-alive": "del loss, y\ntime.sleep(0.3)\nassert mid.grad_fn is not None\ndel mid\n",
    "drop-mid-then-loss": "del mid\ntime.sleep(0.1)\ndel loss, y\n",
    "backward-then-drop": "loss.backward()\nassert x.grad is not None\ndel loss, y, mid\n",
    "mid-backward-after-loss-dropped": "del loss, y\ntime.sleep(0.3)\nmid.sum().backward()\n"
                                       "assert x.grad is not None\ndel mid\n",
    "second-inspect-of-mid": "r2 = gradscope.inspect(mid)\ndel loss, y\ntime.sleep(0.2)\ndel mid, r2\n",
    "alive-at-exit": "",
}


def _script(names, tmp, n=50_000) -> str:
    code = ["import gc, os, sys, time, torch, gradscope", f"N = {n}", f"TMP = {str(tmp)!r}"]
    for i, name in enumerate(names):
        code.append(_CHAIN)
        if i == 0:
            code.append(_RENDER)
        code.append(_SCENARIOS[name])
        code.append("del report\ntime.sleep(0.2)\n" if name != "alive-at-exit" else "")
        code.append(f"print('done {name}', flush=True)")
    code.append("print('OK')")
    return "\n".join(code)


def _run_script(code):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-500:], proc.stderr[-3000:])
    assert proc.stdout.strip().endswith("OK")


def test_50k_chain_inspected_rendered_freed_all_scenarios(tmp_path):
    # One process, one fresh 50k chain per scenario (rendered collapsed once), the last one still
    # alive at interpreter exit. A crash names the last scenario that finished in stdout.
    order = [n for n in _SCENARIOS if n != "alive-at-exit"] + ["alive-at-exit"]
    _run_script(_script(order, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(_SCENARIOS))
def test_50k_chain_scenario_alone(scenario, tmp_path):
    _run_script(_script([scenario], tmp_path))


# -- deep graphs owned last by someone else than the loss ---------------------------------
_OWNED_LATER = """
import gc, time, torch, gradscope
from gradscope.walk.release import pending
w = torch.randn(8, requires_grad=True)
h = w
for i in range(N):
    h = h * 1.0001
    if i == N // 2:
        mid = h                      # an activation kept for logging
loss = h.sum(); del h
rep = gradscope.inspect(loss, params={"w": w})
y = loss * 2                         # a scaled loss that keeps the whole graph
del loss; gc.collect(); time.sleep(0.3)
assert pending() == 1                # still owned by y: nothing released yet
del y; time.sleep(0.3)               # the top half dies; the bottom half is owned by mid
assert mid.grad_fn is not None
mid.sum().backward(retain_graph=True)
assert w.grad is not None
del mid
deadline = time.time() + 20
while pending() and time.time() < deadline:
    time.sleep(0.05)
assert pending() == 0, pending()
print("survived")
"""


def test_deep_graph_freed_by_a_later_tensor_and_a_kept_activation():
    # a deep graph freed through a later tensor, and one freed from the middle: torch alone frees these;
    # after inspect() the last drop (of y, then of mid) used to overflow the C stack.
    code = f"N = 120_000\n{_OWNED_LATER}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.strip() == "survived"


def test_deep_graph_inspected_twice_is_still_freed():
    # Two inspections of one deep graph used to hold each other's node references forever (each list
    # saw the other's reference as an outside owner): the activations never died.
    from gradscope.walk.release import pending

    w = torch.randn(4, requires_grad=True)
    h = w
    for _ in range(12_000):
        h = torch.sin(h)
    act = StorageWeakRef(h.untyped_storage())
    loss = h.sum()
    del h
    reports = [gradscope.inspect(loss, params={"w": w}) for _ in range(2)]
    assert pending() >= 1
    del loss
    deadline = time.time() + 20
    while pending() and time.time() < deadline:
        time.sleep(0.02)
    assert pending() == 0 and act.expired()
    assert reports[1].graph.number_of_nodes() == 12_002


def test_swap_mode_to_after_trace_and_inspect():
    """torch.utils.swap_tensors (module.to() in swap mode, FSDP2's DTensor parameters) refuses a tensor with
    a weak reference: a live Trace or Report must hold none on a parameter; the cut still names it."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    with gradscope.trace(model) as tr:
        hidden = model[0](torch.randn(2, 3)).detach()  # a cut: model.0's parameters get no gradient
        loss = model[1](hidden).sum()
    report = gradscope.inspect(loss, model=model, trace=tr)
    cut = next(f for f in report.findings if f.location)
    assert "0.weight" in cut.message
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)  # raised "_apply(): Couldn't swap Linear.weight" while tr was alive
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
    assert model[0].weight.dtype == torch.float64
    assert tr is not None and report is not None  # both alive during the swap
