"""Reentrant checkpoint regions with their own ``forward``, modelled when the forward ran under
``gradscope.trace()`` (memory/replay/traced.py NOTE [traced reentrant regions]): the recorded calls are replayed on
meta and the nested backward replayed over that graph. Ground truth: torch.profiler (tests/_memtruth.py),
with ``.grad`` empty and already set; the same regions untraced stay listed as unmodelled lower bounds.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import gradscope
from tests._memtruth import measure
from tests._zoo import docs_example
from tests.fuzz._vocab import ScaleF
from tests.memory.test_backward_memory_reentrant import _nested_names


class _Residual(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.mlp(x)


class _Block(docs_example("memory_example").Block):
    """docs/memory_example.py's pre-LN block (d=32, 4 heads), its softmax attention written out."""

    def __init__(self, d=32, heads=4):
        super().__init__(d, heads)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = [z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v)]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class _Dropped(nn.Module):
    def __init__(self, d=48):
        super().__init__()
        self.lin, self.drop, self.lin2 = nn.Linear(d, d), nn.Dropout(0.25), nn.Linear(d, d)

    def forward(self, x):
        return x + self.lin2(self.drop(torch.relu(self.lin(x))))


class _Stack(nn.Module):
    def __init__(self, make, n=2, d=64, preserve=True):
        super().__init__()
        self.blocks = nn.ModuleList(make() for _ in range(n))
        self.head = nn.Linear(d, 1)
        self.preserve = preserve

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=True, preserve_rng_state=self.preserve)
        return self.head(x)


def _loss(m, x):
    return m(x).pow(2).mean()


def _shared():
    model = _Stack(_Residual)
    model.blocks[1] = model.blocks[0]  # one block run twice: the second nested backward adds to its .grads
    return model


class _SharedOutside(nn.Module):
    """``lin`` inside the region and after it: the outer AccumulateGrad sets its .grad first."""

    def __init__(self):
        super().__init__()
        self.lin, self.mlp = nn.Linear(64, 64), _Residual()

    def forward(self, x):
        return self.lin(checkpoint(lambda h: h + self.lin(self.mlp(h)), x, use_reentrant=True))


CASES = {
    "residual": lambda: (_Stack(_Residual), torch.randn(16, 64, requires_grad=True), _loss),
    "block": lambda: (_Stack(_Block, d=32), torch.randn(2, 8, 32, requires_grad=True), _loss),
    "dropout_rng": lambda: (_Stack(_Dropped, d=48), torch.randn(8, 48, requires_grad=True), _loss),
    "shared": lambda: (_shared(), torch.randn(16, 64, requires_grad=True), _loss),
    "shared_outside": lambda: (_SharedOutside(), torch.randn(16, 64, requires_grad=True), _loss),
    "dropout_no_rng": lambda: (_Stack(_Dropped, d=48, preserve=False), torch.randn(8, 48, requires_grad=True), _loss),
}


def _traced_truth(model, inputs, loss_fn):
    def forward():
        with gradscope.trace(model) as tr:
            loss = loss_fn(model, *inputs)
        forward.tr = tr
        return loss, model

    loss, _ = forward()  # warm gradscope's caches outside the profiled run
    gradscope.inspect(loss, model=model, trace=forward.tr).backward_memory()
    del loss
    gc.collect()  # earlier tests' garbage, collected inside the profiled run, would read as this step's frees
    gc.disable()
    try:
        return measure(forward, before=inputs, predict=lambda r, _: r.backward_memory(),
                       inspect=lambda loss, m: gradscope.inspect(loss, model=m, trace=forward.tr))
    finally:
        gc.enable()


def _check(truth):
    bm = truth.prediction
    assert bm.unmodelled == []
    assert bm.names == truth.order
    assert _nested_names(truth.report, bm) == truth.nested          # the nested engines' order, node by node
    assert max(abs(a - b) for a, b in zip(bm.levels, truth.levels)) <= 4096, (bm.levels, truth.levels)
    for i, name in enumerate(bm.names):                             # inside each checkpoint node: its top
        if name == "CheckpointFunctionBackward":
            assert abs(bm.inner[i] - truth.inner[i]) <= 4096, (i, bm.inner[i], truth.inner[i])
    assert abs(bm.peak - truth.peak) <= 0.01 * truth.peak, (bm.peak, truth.peak)
    rows = bm.contributors()  # the peak's rows explain it: the nested backward's top and earlier .grads too
    assert any(kind == "reentrant recompute" for _, kind, _ in rows) == (bm.names[bm.order.index(bm.peak_node)]
                                                                      == "CheckpointFunctionBackward")
    assert abs(sum(b for _, _, b in rows) - bm.peak) <= 4, (rows, bm.peak)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("grad_set", [False, True], ids=["nograd", "grad"])
def test_traced_region_matches_the_profiler(case, grad_set):
    torch.manual_seed(0)
    model, x, loss_fn = CASES[case]()
    if grad_set:
        loss_fn(model, x).backward()
    _check(_traced_truth(model, (x,), loss_fn))


def test_untraced_the_same_regions_stay_lower_bounds():
    torch.manual_seed(0)
    model, x, loss_fn = CASES["block"]()
    truth = measure(lambda: (loss_fn(model, x), model), before=(x,),
                    inspect=lambda loss, m: gradscope.inspect(loss, model=m), predict=lambda r, _: r.backward_memory())
    bm = truth.prediction
    assert len(bm.unmodelled) == 2 and truth.peak > bm.peak and "lower bounds" in str(bm)
    assert bm.unmodelled_why == {} and "gradscope.trace()" in str(bm)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("arch,attn", [("gpt2", "eager"), ("gpt2", "sdpa"), ("llama", "sdpa")])
def test_hf_reentrant_gradient_checkpointing(arch, attn):
    # HF runs each decoder layer's own forward in checkpoint(layer.__call__, ..., use_reentrant=True);
    # sdpa: CPU's flash kernel (one node saving output and logsumexp), Llama's grouped-query heads
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=32, num_key_value_heads=2)
    cfg._attn_implementation = attn
    model = getattr(transformers, "GPT2LMHeadModel" if arch == "gpt2" else "LlamaForCausalLM")(cfg).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    tok = torch.randint(0, 64, (2, 12))
    loss_fn = lambda m, t: m(input_ids=t, labels=t).loss  # noqa: E731
    truth = _traced_truth(model, (tok,), loss_fn)
    assert truth.order.count("CheckpointFunctionBackward") == 2
    _check(truth)
    untraced = gradscope.inspect(loss_fn(model, tok), model=model).backward_memory()
    assert len(untraced.unmodelled) == 2


def _traced_report(fn, x, model):
    with gradscope.trace(model) as tr:
        loss = checkpoint(fn, x, use_reentrant=True).pow(2).sum()
    return gradscope.inspect(loss, model=model, trace=tr)


@pytest.mark.parametrize("kind", ["function", "meta", "leaf"])
def test_what_cannot_be_replayed_stays_a_lower_bound(kind):
    torch.manual_seed(0)
    lin, x = nn.Linear(8, 8), torch.randn(6, 8, requires_grad=True)
    stray = torch.randn(8, requires_grad=True)                      # requires grad, not the model's
    fn, why = {
        "function": (lambda h: ScaleF.apply(lin(h)), "autograd Function"),
        "meta": (lambda h: lin(h)[torch.nonzero(h[:, 0] > 0).squeeze(1)], "on meta"),   # data-dependent shape
        "leaf": (lambda h: lin(h) * stray, "no parameter of the model"),
    }[kind]
    report = _traced_report(fn, x, lin)
    bm = report.backward_memory()
    assert len(bm.unmodelled) == 1 and "lower bound" in str(bm) and why in str(bm)   # said, with the cause
    traced = report.graph.nodes[bm.unmodelled[0]]["attrs"]["region_recompute"]["traced"]
    assert why in (traced["reason"] or traced.get("replay") or "") and why in bm.unmodelled_why[bm.unmodelled[0]]


def test_the_recorded_path_of_data_dependent_code_is_replayed():
    torch.manual_seed(0)
    lin, x = nn.Linear(8, 8), torch.randn(6, 8, requires_grad=True)
    report = _traced_report(lambda h: lin(h)[: 2 + int(h.sum().item() > 0)], x, lin)   # Python sees a number
    truth = measure(lambda: (checkpoint(lambda h: lin(h)[: 2 + int(h.sum().item() > 0)], x,
                                        use_reentrant=True).pow(2).sum(), lin), before=(x,))
    bm = report.backward_memory()
    assert bm.unmodelled == [] and bm.names == truth.order
    assert max(abs(a - b) for a, b in zip(bm.levels, truth.levels)) <= 4096


def _run(traced: bool):
    torch.manual_seed(0)
    model, x, _ = CASES["dropout_rng"]()
    torch.manual_seed(1)
    if traced:
        with gradscope.trace(model) as tr:
            out = model(x)
        gradscope.inspect(out.pow(2).mean(), model=model, trace=tr).backward_memory()
    else:
        out = model(x)
    out.pow(2).mean().backward()
    return [out.detach(), x.grad, *(p.grad for p in model.parameters()), torch.get_rng_state()]


def test_no_harm_bit_identical_nothing_kept_alive_swap_to_works():
    assert all(torch.equal(a, b) for a, b in zip(_run(False), _run(True)))   # outputs, grads, RNG state
    for _ in range(2):          # the first checkpoint call of a process keeps its arguments (torch, not us)
        torch.manual_seed(0)
        model, x, _ = CASES["block"]()
        kept = []
        model.blocks[0].register_forward_hook(lambda m, i, o, kept=kept: kept.append(weakref.ref(o)))
        gc.disable()            # freed by reference counting alone: no cycle through the trace or the report
        try:
            with gradscope.trace(model) as tr:
                out = model(x)
            report = gradscope.inspect(out.pow(2).mean(), model=model, trace=tr)
            bm = report.backward_memory()
            refs = [weakref.ref(x), weakref.ref(out), *kept]
            del x, out, kept
        finally:
            gc.enable()
    assert bm.unmodelled == [] and [r() for r in refs] == [None] * 3
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:                                            # swap_tensors refuses a parameter with a weak reference
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
    assert all(p.dtype == torch.float64 for p in model.parameters()) and tr is not None and report is not None
