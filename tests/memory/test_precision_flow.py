"""The dtype flow of a traced forward (NOTE [dtype flow]) against a real bfloat16 run of the same model.

Ground truth: a bfloat16 copy of the model (what FSDP2's ``param_dtype=torch.bfloat16`` runs), its graph
read by ``inspect`` (the dtype of every saved slot and output) and its backward measured with
torch.profiler; the prediction: the float32 model traced once, replayed in bfloat16
(``memory/sharding/precision.py``).
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch import nn

import gradscope
from gradscope.graph import DTYPE_FLOW
from gradscope.memory.planning.change import change_overrides, replay_change
from gradscope.memory.sharding.precision import F32_SLOTS, in_param_dtype
from tests._memtruth import measure
from tests._shardmodels import batch, build, loss_of
from tests._steptruth import apply_changes


class Norm(nn.Module):
    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)


class Upcasts(nn.Module):
    """Each way a model asks for float32 on purpose: an RMSNorm-like cast and cast back (in a module of its
    own, as models write it), softmax with ``dtype=`` cast back to the query's dtype on the same line,
    ``type_as``, a float32 buffer by type promotion, a factory with ``dtype=torch.float32``."""

    def __init__(self, d: int = 32, promote: bool = True):
        super().__init__()
        self.promote = promote
        self.inp, self.norm = nn.Linear(d, d), Norm()
        self.q, self.k, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        x = self.inp(x)
        h = self.norm(x)
        q, k = self.q(h), self.k(h + x)
        w = torch.softmax(q @ k.transpose(-1, -2), dim=-1, dtype=torch.float32).to(q.dtype)
        y = (w @ q).type_as(x)
        if self.promote:  # float32 by promotion with the buffer, and a float32 factory
            y = y * self.scale + torch.ones(y.shape[-1], dtype=torch.float32)
        return self.out(y.to(x.dtype))


class Half(nn.Module):
    def forward(self, x):
        return x * 0.5  # saves nothing


class NormBlocks(nn.Module):
    """Residual blocks that read their input only through an RMSNorm-like float32 copy (Llama's layers), or
    (``first=Half``) through an op that saves nothing: no op saves the input, in float32 either."""

    def __init__(self, d: int = 32, n: int = 3, first=Norm):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Sequential(first(), nn.Linear(d, d)) for _ in range(n))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return x


def _models():
    out = [("gpt", lambda: build("gpt"), batch("gpt", 8)), ("upcasts", Upcasts, torch.randn(4, 6, 32))]
    try:
        import transformers  # noqa: F401
    except ImportError:
        return out
    return [*out, ("llama", lambda: build("llama"), batch("llama", 8))]


MODELS = _models()
#: The replay node by node: without the float32 buffer, whose product with a bfloat16 activation makes the
#: backward cast its gradient inside the node (a transient of the node, not replayed)
REPLAYED = [m if m[0] != "upcasts" else ("upcasts", lambda: Upcasts(promote=False), m[2]) for m in MODELS]


def _bf16(model, x):
    """The model and input as FSDP2's ``param_dtype=torch.bfloat16`` runs them: the parameters and the floating
    inputs in bfloat16, the buffers in their own dtype."""
    model = copy.deepcopy(model)
    for m in model.modules() if model is not None else ():
        for n, p in m._parameters.items():
            if p is not None:
                m._parameters[n] = nn.Parameter(p.detach().to(torch.bfloat16))
    return model, x.to(torch.bfloat16) if x.is_floating_point() else x


def _traced(model, x):
    with gradscope.trace(model) as tr:
        loss = loss_of(model(x))
    return gradscope.inspect(loss, model=model, trace=tr)


def _ops(report):
    g = report.graph
    nodes = sorted(g.nodes(data=True), key=lambda nd: nd[1].get("seq") or -1)
    return [(n, d) for n, d in nodes if d.get("kind") == "op" and d["name"] != "ToCopyBackward0"]


@pytest.mark.parametrize("name, make, x", MODELS, ids=[m[0] for m in MODELS])
def test_traced_float32_forward_knows_every_tensor_a_bf16_run_keeps_in_float32(name, make, x):
    """Per node, in creation order: the saved slots and the outputs that the bfloat16 run holds in float32
    are exactly the ones the float32 trace's flow (and the ops' own float32 slots) names."""
    model = make()
    traced = _traced(model, x)
    bf, xb = _bf16(model, x)
    real = gradscope.inspect(loss_of(bf(xb)))
    flow = traced.graph.graph[DTYPE_FLOW]["nodes"]
    ours, theirs = _ops(traced), _ops(real)
    assert [d["name"] for _, d in ours] == [d["name"] for _, d in theirs]
    kept = 0
    for (nid, d), (_, r) in zip(ours, theirs):
        up = set(flow.get(nid, {}).get("saved", ()))
        for mine, e in zip(d["saved"] or (), r["saved"] or ()):
            if e.get("dtype") in ("float32", "bfloat16") and mine.get("dtype") == "float32":
                said = mine.get("storage") in up or mine.get("slot") in F32_SLOTS
                assert said == (e["dtype"] == "float32"), (name, d["name"], e.get("slot"), e["dtype"])
                kept += e["dtype"] == "float32"
        real_out = [j for j, dt in enumerate(r.get("out_dtypes") or []) if dt == "float32"]
        assert sorted(flow.get(nid, {}).get("outputs", [])) == real_out, (name, d["name"])
    assert kept > 0  # every model here keeps something in float32


@pytest.mark.parametrize("name, make, x", REPLAYED, ids=[m[0] for m in REPLAYED])
def test_bf16_backward_replayed_from_the_float32_trace_matches_the_real_one_node_by_node(name, make, x):
    """The backward of the bfloat16 model, measured with torch.profiler: the engine's order (the casts'
    ToCopyBackward0 nodes included) and the level after every node equal the replay's."""
    model = make()
    report = _traced(model, x)
    ov, _, regions, off = change_overrides(report)
    mem = replay_change(report, ov, regions, off, None, lambda p: in_param_dtype(p, report.graph, "bfloat16"))
    bf, _ = _bf16(model, x)
    truth = measure(lambda: (loss_of(bf(_bf16(None, x)[1])), bf))  # the input cast inside, as FSDP2's root does
    assert [o == "ToCopyBackward0" for o in truth.order] == [":cast" in n for n in mem.order]
    assert truth.levels == mem.levels and truth.peak == mem.peak
    assert any(":cast" in n for n in mem.order)


CHECKPOINTED = [("norm-blocks", NormBlocks, torch.randn(4, 6, 32), "blocks"),
                ("unsaved-input", lambda: NormBlocks(first=Half), torch.randn(4, 6, 32), "blocks")]
BLOCKS = {"gpt": "blocks", "llama": "lm.model.layers"}
CHECKPOINTED += [(n, make, x, BLOCKS[n]) for n, make, x in MODELS if n in BLOCKS]


@pytest.mark.parametrize("name, make, x, blocks", CHECKPOINTED, ids=[m[0] for m in CHECKPOINTED])
def test_bf16_checkpoint_per_block_holds_each_blocks_input_as_the_real_checkpoint_does(name, make, x, blocks):
    """A checkpoint per block replayed in bfloat16 from the float32 trace, against the bfloat16 model with a
    real non-reentrant checkpoint per block (torch.profiler). In bfloat16 no op saves a block's input (the
    norm saves its float32 copy; ``x * 0.5`` saves nothing): the checkpoint alone holds it, in bfloat16,
    until the block's backward is done. What is alive when backward starts, the level after every node and
    the peak (inside a node: a bfloat16 matmul's own temporaries, measured in bfloat16, NOTE [in-node
    memory]) no lower than the real ones but for 0.1% (Llama's frames also hold the int64 position ids,
    which no node shows), the first and the peak within 1% above."""
    torch.manual_seed(0)
    model = make()
    report = _traced(model, x)
    names = [f"{blocks}.{i}" for i in range(3)]
    ov, _, regions, off = change_overrides(report, checkpoint=names)
    mem = replay_change(report, ov, regions, off, None, lambda p: in_param_dtype(p, report.graph, "bfloat16"))
    bf, _ = _bf16(model, x)
    apply_changes(bf, checkpoint_names=names)
    truth = measure(lambda: (loss_of(bf(_bf16(None, x)[1])), bf))
    # the float32 batch exists before the profiled run (the bfloat16 model is given a copy made inside it)
    held = sum(v for k, v in mem.parts.items() if k not in ("parameters", "buffers", "gradients", "batch"))
    slack = 0.001 * truth.at_backward
    assert truth.at_backward - slack <= held <= 1.01 * truth.at_backward, (name, held, truth.at_backward)
    assert len(mem.levels) == len(truth.levels)
    low = [(i, m + held, t + truth.at_backward) for i, (t, m) in enumerate(zip(truth.levels, mem.levels))
           if m + held < t + truth.at_backward - slack]
    assert not low, (name, low[:3])
    real = truth.at_backward + truth.peak
    assert real - slack <= held + mem.peak <= 1.01 * real, (name, held + mem.peak, real)


def test_recording_the_casts_changes_nothing():
    """The same outputs and gradients as an untraced run; no parameter or buffer gets a weak reference
    (``torch.utils.swap_tensors`` refuses one that has); a no-op cast is still the tensor itself."""
    model, x = Upcasts(), torch.randn(4, 6, 32)
    plain = loss_of(model(x))
    plain.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with gradscope.trace(model):
        traced = loss_of(model(x))
        assert x.to(torch.float32) is x and x.float() is x
    traced.backward()
    assert torch.equal(plain, traced)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert all(weakref.getweakrefcount(t) == 0 for t in [*model.parameters(), *model.buffers()])


def test_a_report_without_the_flow_says_its_bf16_peak_is_a_lower_bound_and_a_traced_one_does_not():
    """A report saved before the flow existed (no ``dtype_flow`` key) keeps the old replay and its note."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    spec = gradscope.FSDP(2, modules=["blocks.*"], reshard_after_forward=False, mp_policy=mp)
    model, x = build("gpt"), batch("gpt", 8)
    opt = torch.optim.AdamW(model.parameters())
    traced = _traced(model, x).what_if(shard=spec, optimizer=opt)
    old = _traced(model, x)
    del old.graph.graph[DTYPE_FLOW]
    before = old.what_if(shard=spec, optimizer=opt)
    assert "lower bound" in str(before) and "lower bound" not in str(traced)
    assert "followed by gradscope.trace" in str(traced)
    assert traced.peak > before.peak  # the loss on logits.float() in float32


def test_ops_that_keep_float32_by_themselves_on_cpu():
    """docs/internals.md#float32-saved-slots: under bfloat16 inputs, CPU scaled_dot_product_attention (the
    flash kernel) saves its ``logsumexp`` in float32, while CPU layer_norm saves mean and rstd in bfloat16."""
    q = torch.randn(2, 4, 16, 8, dtype=torch.bfloat16, requires_grad=True)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert "logsumexp" in F32_SLOTS and out.grad_fn._saved_logsumexp.dtype == torch.float32
    h = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    ln = torch.nn.functional.layer_norm(h, (16,))
    assert ln.grad_fn._saved_result1.dtype == torch.bfloat16 and ln.grad_fn._saved_result2.dtype == torch.bfloat16
