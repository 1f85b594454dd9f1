"""Replay mechanisms checked one by one on small programs against torch.profiler (tests/_memtruth.py):
the input batch in the absolute peak, pass-through nodes, non-reentrant checkpoint recompute and levels."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradscope
from tests._memtruth import measure
from tests.fuzz._memprogram import Residual  # LayerNorm, a GELU MLP and a residual

warnings.filterwarnings("ignore", message=".*use_reentrant.*")


#: The in-node measurements of this module go to a cache of its own (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("module_cache_dir")


def _truth(forward, model, batch, retain_graph=False, **kw):
    """Warm the workspace cache, then measure ``forward()`` with the prediction taken inside the run."""
    gradscope.inspect(forward(), model=model).backward_memory(retain_graph=retain_graph, **kw)
    return measure(lambda: (forward(), model), before=batch, retain_graph=retain_graph,
                   inspect=lambda loss, m: gradscope.inspect(loss, model=m),
                   predict=lambda r, _: r.backward_memory(retain_graph=retain_graph, **kw))


@pytest.mark.parametrize("first", ["saved", "not-saved"])
def test_absolute_peak_counts_the_batch_once(first):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    x = torch.randn(32, 64)
    op = (lambda t: t) if first == "saved" else (lambda t: t * 1.0)  # x * 1.0 saves nothing
    without = gradscope.inspect(m(op(x)).sum(), model=m).backward_memory()  # before any .grad exists
    truth = _truth(lambda: m(op(x)).sum(), m, [x], inputs=[x])
    assert truth.prediction.absolute_peak == truth.absolute_peak
    assert truth.prediction.absolute_peak - without.absolute_peak == (0 if first == "saved" else x.nbytes)


def test_batch_that_requires_grad_is_counted_once():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    x = torch.randn(32, 64, requires_grad=True)
    target = torch.randn(32, 64)
    truth = _truth(lambda: ((m(x * 2.0) - target) ** 2).sum(), m, [x, target], inputs={"x": x, "y": [target]})
    assert abs(truth.prediction.absolute_peak - truth.absolute_peak) <= 64  # 8 B: a wrapped scalar
    assert truth.prediction.parts["leaf inputs"] == x.nbytes  # x is a leaf too: counted once, there
    assert truth.prediction.parts["batch"] == target.nbytes


@pytest.mark.parametrize("shape", ["residual", "transposed", "reshaped"])
def test_pass_through_nodes_do_not_materialize_sums_gradient(shape):
    # sum()'s gradient is a stride-0 expand of one element: add and clone send that tensor on, t() and
    # view() send views of it; none allocates the full gradient (the Linear's addmm does)
    torch.manual_seed(0)
    m = nn.Module()
    m.W = nn.Parameter(torch.randn(128, 128) / 11.3)
    m.lin = nn.Linear(128, 128)
    x = torch.randn(8, 128)

    def forward():
        h = x @ m.W
        if shape == "residual":
            return (h + m.lin(h)).sum()
        if shape == "transposed":
            return (m.lin(h).t().clone() + h.t()).sum()
        return (m.lin(h).reshape(16, 64) + h.view(16, 64)).sum()

    truth = _truth(forward, m, [x])
    bm = truth.prediction
    assert bm.names == truth.order
    assert max(abs(a - b) for a, b in zip(bm.levels, truth.levels)) <= 64
    assert abs(bm.peak - truth.peak) <= 0.01 * truth.peak


def _levels_and_peak(truth, level_tol=64, peak_tol=0.005):
    bm = truth.prediction
    assert bm.names == truth.order
    worst = max(abs(a - b) for a, b in zip(bm.levels, truth.levels))
    assert worst <= level_tol, f"a level off by {worst} B"
    assert abs(bm.peak - truth.peak) <= peak_tol * truth.peak, (bm.peak, truth.peak)


def test_checkpoint_recompute_temporaries_and_rng_copy_are_in_the_peak():
    # the region's first unpack re-runs Linear -> ReLU under fork_rng (a copy of the RNG state): the
    # Linear's output, which no node saves, lives until the ReLU has run
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = nn.ModuleDict(dict(
        lin=nn.Linear(16, 16),
        blk=nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)),
        head=nn.Linear(16, 10),
    ))
    x, t = torch.randn(16, 16), torch.randint(0, 10, (16,))
    truth = _truth(lambda: F.cross_entropy(m.head(checkpoint(m.blk, m.lin(x), use_reentrant=False)), t), m, [x, t])
    _levels_and_peak(truth)


@pytest.mark.parametrize("retain_graph", [False, True])
def test_checkpoint_levels_with_retain_graph(retain_graph):
    # checkpoint hands each recomputed tensor over at its unpack and keeps none, retain_graph or not
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = nn.ModuleDict(dict(blk=Residual(128), lin=nn.Linear(128, 128)))
    x = torch.randn(16, 128)
    truth = _truth(lambda: (m.lin(checkpoint(m.blk, x, use_reentrant=False)) ** 2).mean(), m, [x], retain_graph)
    _levels_and_peak(truth, level_tol=4096, peak_tol=0.01)


def test_checkpoint_input_saved_by_the_op_before_is_freed_with_its_last_holder():
    # sigmoid saves its output, which is also the region's input (kept by the checkpoint frame): it is
    # freed when the sigmoid's node has run and the region's nodes are done, not kept to the end
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = nn.ModuleDict(dict(lin=nn.Linear(128, 128), blk=Residual(128)))
    x = torch.randn(32, 128)

    def forward():
        h = checkpoint(m.blk, torch.sigmoid(m.lin(x)), use_reentrant=False)
        return (h * h).sum()

    truth = _truth(forward, m, [x])
    _levels_and_peak(truth, level_tol=4096, peak_tol=0.01)


@pytest.mark.parametrize("op", ["linear", "layer_norm", "softmax", "tanh"])
def test_kernels_copy_sums_expanded_gradient_unless_they_read_it_in_place(op):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64))
    x = torch.randn(32, 64)
    f = {"linear": lambda h: h, "layer_norm": lambda h: F.layer_norm(h, (64,)),
         "softmax": lambda h: torch.softmax(h, -1), "tanh": torch.tanh}[op]
    truth = _truth(lambda: f(m(x)).sum(), m, [x])
    _levels_and_peak(truth)


def test_checkpoint_binary_op_saving_two_inputs_of_one_shape_recreates_each_once():
    # mul saves sigmoid(h) and h, both (16, 64): each slot is matched to its own input, so the recompute
    # re-creates two tensors, not three
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = nn.ModuleDict(dict(fc=nn.Linear(64, 64), head=nn.Linear(64, 64)))
    x = torch.randn(16, 64)

    def gated(a):
        h = m.fc(a)
        return (torch.sigmoid(h) * h).tanh() + h.mean(-1, keepdim=True)

    truth = _truth(lambda: m.head(checkpoint(gated, x, use_reentrant=False)).pow(2).mean(), m, [x])
    _levels_and_peak(truth, level_tol=4096, peak_tol=0.01)


def test_densenet_like_cat_sums_its_pieces_at_the_gradients_size():
    # cat([h, h]) sends two pieces of one gradient to h; their sum has h's size and the cat's gradient
    # is freed with its last piece (no drift after the first CatBackward0)
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(a=nn.Linear(64, 64), b=nn.Linear(128, 64), c=nn.Linear(128, 64)))
    x = torch.randn(32, 64)

    def forward():
        h = m.a(x)
        h = m.b(torch.cat([h, h], 1))
        return m.c(torch.cat([h, torch.tanh(h)], 1)).pow(2).mean()

    truth = _truth(forward, m, [x])
    _levels_and_peak(truth)


def test_tied_embedding_weight_sums_its_two_gradients_out_of_place():
    # the output layer's weight gradient (a transposed view of mm's output) reaches the shared weight's
    # InputBuffer first; the embedding's dense gradient arrives second and torch adds ``old + new`` (a third
    # buffer for a moment) rather than reusing the sole new one: before this was modelled the peak was 33% low
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(emb=nn.Embedding(100, 32), mid=nn.Linear(32, 32), head=nn.Linear(32, 100, bias=False)))
    m.head.weight = m.emb.weight
    ids = torch.randint(0, 100, (2, 8))
    truth = _truth(lambda: m.head(torch.tanh(m.mid(m.emb(ids)))).logsumexp(-1).mean(), m, [ids])
    _levels_and_peak(truth)
    assert truth.peak > 2 * m.emb.weight.nbytes  # the old gradient, the new one and their sum coexist


def _inner_levels(truth, tol=64):
    """Every node's highest point (in-node memory included) within ``tol`` of the profiler's."""
    bm = truth.prediction
    worst = max(abs(a - b) for a, b in zip(bm.inner, truth.inner))
    assert worst <= tol, f"a node's highest point off by {worst} B"


class _Patches(nn.Module):
    """A ViT-like patch embedding: the convolution's output flattened and transposed into tokens."""

    def __init__(self, cls_token: bool):
        super().__init__()
        self.proj = nn.Conv2d(3, 32, 8, stride=8)
        self.cls = nn.Parameter(torch.randn(1, 1, 32)) if cls_token else None
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, 2)

    def forward(self, px):
        h = self.proj(px).flatten(2).transpose(1, 2)
        if self.cls is not None:
            h = torch.cat([self.cls.expand(len(px), -1, -1), h], 1)
        return self.head(self.ln(h)[:, 0])


@pytest.mark.parametrize("cls_token", [False, True], ids=["tokens", "cls-token-cat"])
def test_patch_embedding_convolution_gets_a_channels_last_strided_gradient(cls_token):
    # the gradient of flatten(2).transpose(1, 2) reaches the convolution as a transposed view, which its
    # backward copies (4 KiB here, 7.6% of HF ViT's peak when measured on a contiguous one); with a class
    # token, the transpose's gradient is a piece of cat's gradient and stays a view (no copy)
    torch.manual_seed(0)
    m = _Patches(cls_token)
    px, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    truth = _truth(lambda: F.cross_entropy(m(px), y), m, [px, y])
    _levels_and_peak(truth, peak_tol=0.001)
    _inner_levels(truth)


def test_reshape_of_a_permuted_gradient_copies_it():
    # heads split with view + permute: bmm's gradient (contiguous) permuted back is not viewable as
    # (B, T, C), so the view's backward copies it (PVT-v2's and every attention block's q/k/v)
    torch.manual_seed(0)
    m = nn.Module()
    m.q, m.k, m.v, m.o = (nn.Linear(32, 32) for _ in range(4))
    x = torch.randn(2, 16, 32)

    def heads(t):
        return t.view(2, 16, 2, 16).permute(0, 2, 1, 3)

    def forward():
        a = torch.softmax(heads(m.q(x)) @ heads(m.k(x)).transpose(-1, -2), -1)
        return m.o((a @ heads(m.v(x))).permute(0, 2, 1, 3).reshape(2, 16, 32)).pow(2).mean()

    truth = _truth(forward, m, [x])
    _levels_and_peak(truth)
    _inner_levels(truth)


def test_mean_of_a_channels_last_block_sends_a_contiguous_gradient():
    # mean()'s gradient is contiguous although the block's activation is channels-last, so the permute
    # back to (N, H, W, C) before a Linear is not viewable as (N*H*W, C): the view's backward copies it
    torch.manual_seed(0)
    m = nn.Module()
    m.fc = nn.Linear(8, 8)
    x = torch.randn(2, 8, 8, 8).to(memory_format=torch.channels_last)

    def forward():
        return (x + m.fc(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)).pow(2).mean()

    truth = _truth(forward, m, [x])
    _levels_and_peak(truth, peak_tol=0.001)
    _inner_levels(truth)


def test_reshape_stride_is_torchs():
    from gradscope.memory.kernels.layout import reshape_stride

    torch.manual_seed(0)
    cases = 0
    for shape, perm, new in [((2, 16, 32), (0, 2, 1), (2, 32, 4, 4)), ((2, 16, 32), (0, 2, 1), (2, 512)),
                             ((2, 2, 16, 16), (0, 2, 1, 3), (2, 16, 32)), ((4, 6), (1, 0), (24,)),
                             ((3, 1, 5), (2, 1, 0), (5, 3)), ((2, 3, 4, 5), (0, 2, 3, 1), (2, 20, 3)),
                             ((2, 3, 4, 5), (0, 1, 3, 2), (6, 5, 4)), ((2, 3, 4), (0, 1, 2), (4, 3, 2))]:  # fmt: skip
        for narrow in (False, True):
            base = torch.empty(shape, device="meta")
            t = base.permute(perm)
            if narrow:  # a piece of a larger tensor, as cat's gradient pieces are
                t = torch.empty([shape[0] + 1, *shape[1:]], device="meta").permute(perm).narrow(perm.index(0), 0,
                                                                                              shape[0])
            if t.numel() != math.prod(new):
                continue
            r = t.reshape(new)
            got = reshape_stride(list(t.shape), list(t.stride()), list(new))
            assert (got is not None) == r._is_view(), (shape, perm, new, narrow)
            assert got is None or got == list(r.stride())
            cases += 1
    assert cases >= 12


def test_channels_last_weight_gradient_is_cloned_into_the_weights_layout():
    # tokens reshaped back to an image (PVT-v2's spatial reduction): the convolution's input is
    # channels-last-strided, so is its weight gradient, and AccumulateGrad clones it to the contiguous
    # weight's layout instead of stealing it (the weight's bytes more inside that node)
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(lin=nn.Linear(16, 16), conv=nn.Conv2d(16, 16, 2, stride=2)))
    x = torch.randn(2, 64, 16)
    truth = _truth(lambda: m.conv(m.lin(x).permute(0, 2, 1).reshape(2, 16, 8, 8)).pow(2).mean(), m, [x])
    _levels_and_peak(truth)
    _inner_levels(truth)
