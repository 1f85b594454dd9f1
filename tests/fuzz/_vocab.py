"""The fuzzer's vocabulary: differentiable (and deliberately non-differentiable) torch ops.

Every op maps the pool's working shape ``(2, 4)`` back to ``(2, 4)`` so any op can follow any other.
``fn(P, s, t)`` gets the named parameters ``P`` and two pool tensors; out-of-place ops return a new tensor,
in-place ops mutate ``s`` (or a view of it) and return ``None``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["OPS", "INPLACE", "make_params", "TORCH_OPS", "SLOW_ONLY"]


def make_params() -> dict[str, torch.Tensor]:
    """Fresh named parameters (call after ``torch.manual_seed``); ``f`` is frozen."""
    shapes = {"a": (2, 4), "w": (4, 4), "u": (4, 4), "b": (4,), "g": (4,), "e": (6, 4), "k": (2, 2, 3)}
    params = {n: torch.nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
    params["f"] = torch.nn.Parameter(torch.randn(4), requires_grad=False)  # frozen: never flagged
    return params


def _idx(s):
    return (s.detach().abs() * 10).long() % 4


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class ExpF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class ScaleF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.k = 3.0
        ctx.note = "scale"
        return x * 3.0

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k


class MulF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y, g * x


class _Hooked(torch.nn.Module):
    """A module with a full backward hook (Captum, Grad-CAM): its wrapper Functions hide nothing."""

    def forward(self, x, w):
        return torch.tanh(x @ w)


_HOOKED = _Hooked()
_HOOKED.register_full_backward_hook(lambda m, gi, go: None)
_COMPILED: list = []


def _compiled(s, w):
    # torch.compile (aot_eager): one CompiledFunctionBackward node whose inputs are s and w. Slow to
    # compile, so only the slow profile draws it (SLOW_ONLY).
    if not _COMPILED:
        _COMPILED.append(torch.compile(lambda a, b: torch.tanh(a @ b), backend="aot_eager", dynamic=False))
    return _COMPILED[0](s, w)


def _ckpt(fn, s):
    return checkpoint(fn, s, use_reentrant=True)


_PERM = [3, 2, 1, 0]

# name -> fn(P, s, t). Out-of-place first.
OPS: dict = {
    # elementwise unary
    "exp": lambda P, s, t: torch.exp(s),
    "sin": lambda P, s, t: torch.sin(s),
    "tanh": lambda P, s, t: torch.tanh(s),
    "sigmoid": lambda P, s, t: torch.sigmoid(s),
    "relu": lambda P, s, t: F.relu(s),
    "gelu": lambda P, s, t: F.gelu(s),
    "silu": lambda P, s, t: F.silu(s),
    "abs": lambda P, s, t: torch.abs(s),
    "neg": lambda P, s, t: -s,
    "pow": lambda P, s, t: s.pow(2),
    "mul_scalar": lambda P, s, t: s * 3,
    "div_scalar": lambda P, s, t: s / 4.0,
    "clamp": lambda P, s, t: s.clamp(-1, 1),
    "log1p": lambda P, s, t: torch.log1p(s.abs()),
    "sqrt": lambda P, s, t: (s.abs() + 1).sqrt(),
    "dropout": lambda P, s, t: F.dropout(s, 0.5, True),
    # binary
    "add": lambda P, s, t: s + t,
    "sub": lambda P, s, t: s - t,
    "mul": lambda P, s, t: s * t,
    "div": lambda P, s, t: s / (t.abs() + 1),
    "maximum": lambda P, s, t: torch.maximum(s, t),
    "lerp": lambda P, s, t: torch.lerp(s, t, 0.3),
    "atan2": lambda P, s, t: torch.atan2(s, t.abs() + 1),
    # parameters, matmul family
    "matmul": lambda P, s, t: s @ P["w"],
    "linear": lambda P, s, t: F.linear(s, P["w"], P["b"]),
    "bias": lambda P, s, t: s + P["b"],
    "scale": lambda P, s, t: s * P["g"],
    "frozen": lambda P, s, t: s * P["f"],
    "bmm": lambda P, s, t: torch.bmm(s.unsqueeze(0), P["u"].unsqueeze(0)).squeeze(0),
    "mm_t": lambda P, s, t: (s @ t.T) @ s,
    "einsum": lambda P, s, t: torch.einsum("ij,jk->ik", s, P["u"]),
    "addmm": lambda P, s, t: torch.addmm(P["b"], s, P["u"]),
    "param_a": lambda P, s, t: s + P["a"],
    # reductions
    "sum": lambda P, s, t: s.sum(-1, keepdim=True).expand(2, 4),
    "mean": lambda P, s, t: s.mean(0, keepdim=True).expand_as(s),
    "amax": lambda P, s, t: s.amax(-1, keepdim=True) * s,
    "logsumexp": lambda P, s, t: s - s.logsumexp(-1, keepdim=True),
    "prod": lambda P, s, t: s.prod(-1, keepdim=True) + s,
    "var": lambda P, s, t: s.var(0, keepdim=True) + s,
    "vector_norm": lambda P, s, t: s / (torch.linalg.vector_norm(s, dim=-1, keepdim=True) + 1),
    "cumsum": lambda P, s, t: s.cumsum(1),
    # views / reshapes / transposes
    "view_t": lambda P, s, t: s.reshape(4, 2).t(),
    "reshape": lambda P, s, t: s.reshape(1, 8).reshape(2, 4),
    "permute": lambda P, s, t: s.unsqueeze(0).permute(2, 1, 0).reshape(2, 4),
    "flip": lambda P, s, t: s.flip(1),
    "roll": lambda P, s, t: s.roll(1, 1),
    "unsqueeze": lambda P, s, t: s.unsqueeze(1).squeeze(1),
    "expand": lambda P, s, t: s[:1].expand(2, 4),
    "unfold": lambda P, s, t: s.unfold(1, 2, 2).reshape(2, 4),
    "contiguous": lambda P, s, t: s.t().contiguous().t(),
    # indexing / slicing
    "slice_cat": lambda P, s, t: torch.cat([s[:, 1:], s[:, :1]], 1),
    "index": lambda P, s, t: s[:, torch.tensor(_PERM)],
    "gather": lambda P, s, t: s.gather(1, _idx(t)),
    "index_select": lambda P, s, t: s.index_select(1, torch.tensor(_PERM)),
    "select_stack": lambda P, s, t: torch.stack([s[1], s[0]]),
    "narrow_cat": lambda P, s, t: torch.cat([s.narrow(1, 2, 2), s.narrow(1, 0, 2)], 1),
    # cat / split / stack
    "split_cat": lambda P, s, t: torch.cat(s.split(2, 1)[::-1], 1),
    "chunk": lambda P, s, t: (lambda c: torch.cat([c[0] * c[1], c[1]], 0))(s.chunk(2, 0)),
    "stack_sum": lambda P, s, t: torch.stack([s, t]).sum(0),
    "unbind": lambda P, s, t: torch.stack(s.unbind(0)[::-1]),
    # softmax family, losses
    "softmax": lambda P, s, t: torch.softmax(s, -1),
    "log_softmax": lambda P, s, t: F.log_softmax(s, -1),
    "cross_entropy": lambda P, s, t: F.cross_entropy(s, _idx(t)[:, 0], reduction="none")
    .unsqueeze(1).expand(2, 4),
    # norms
    "layer_norm": lambda P, s, t: F.layer_norm(s, (4,), P["g"], P["b"]),
    "layer_norm_plain": lambda P, s, t: F.layer_norm(s, (4,)),
    "group_norm": lambda P, s, t: F.group_norm(s, 2, P["g"], P["b"]),
    "batch_norm": lambda P, s, t: F.batch_norm(s, None, None, training=True),
    "normalize": lambda P, s, t: F.normalize(s, dim=-1),
    "rms": lambda P, s, t: s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6),
    # conv / pooling / embedding
    "conv1d": lambda P, s, t: F.conv1d(s.reshape(1, 2, 4), P["k"], padding=1).reshape(2, 4),
    "max_pool": lambda P, s, t: F.max_pool1d(s.unsqueeze(1), 3, 1, padding=1).squeeze(1),
    "embedding": lambda P, s, t: F.embedding(s.detach().argmax(-1) % 6, P["e"]),
    # where / masked_fill
    "where": lambda P, s, t: torch.where(s > t, s, t),
    "masked_fill": lambda P, s, t: s.masked_fill(t > 0, 0.0),
    # integer ops and other cuts
    "argmax": lambda P, s, t: s.argmax(-1, keepdim=True).float().expand(2, 4),
    "gt": lambda P, s, t: (s > 0).float(),
    "round": lambda P, s, t: s.round(),
    "long": lambda P, s, t: s.long().float(),
    "item": lambda P, s, t: s * s.sum().item(),
    "tolist": lambda P, s, t: torch.tensor(s.tolist()),
    "detach": lambda P, s, t: s.detach(),
    "data": lambda P, s, t: s.data,
    "detach_mul": lambda P, s, t: s.detach() * t,
    # custom autograd.Functions
    "fn_square": lambda P, s, t: Square.apply(s),
    "fn_exp": lambda P, s, t: ExpF.apply(s),
    "fn_scale": lambda P, s, t: ScaleF.apply(s),
    "fn_mul": lambda P, s, t: MulF.apply(s, t),
    # multi-output views saved (by an op, a custom Function, a reentrant checkpoint), in-place
    # writes inside reentrant checkpoint bodies, backward-hook wrappers, compiled regions
    "split_save": lambda P, s, t: torch.cat([v * P["g"] for v in s.split(1, 0)], 0),
    "unbind_save": lambda P, s, t: torch.stack([v * v for v in s.unbind(0)]),
    "fn_square_split": lambda P, s, t: torch.cat([Square.apply(v) for v in s.split(1, 0)], 0),
    "ckpt_split": lambda P, s, t: torch.cat([_ckpt(torch.sin, v) for v in s.split(1, 0)], 0),
    "ckpt_sigmoid_mul_": lambda P, s, t: _ckpt(lambda a: torch.sigmoid(a).mul_(2), s),
    "ckpt_linear_relu_": lambda P, s, t: _ckpt(lambda a: F.linear(a, P["w"]).relu_(), s),
    "ckpt_exp_add_": lambda P, s, t: _ckpt(lambda a: (a * P["g"]).exp().add_(1), s),
    "hooked": lambda P, s, t: _HOOKED(s, P["u"]),
    "compiled": lambda P, s, t: _compiled(s, P["w"]),
}

# Ops the CI profiles never draw (too slow to set up there); the slow profile draws every op.
SLOW_ONLY = frozenset({"compiled"})

INPLACE: dict = {
    "add_": lambda P, s, t: s.add_(t),
    "mul_": lambda P, s, t: s.mul_(2),
    "relu_": lambda P, s, t: s.relu_(),
    "sigmoid_": lambda P, s, t: s.sigmoid_(),
    "exp_": lambda P, s, t: s.exp_(),
    "clamp_": lambda P, s, t: s.clamp_(-1, 1),
    "copy_": lambda P, s, t: s.copy_(t),
    "zero_": lambda P, s, t: s.zero_(),
    "setitem": lambda P, s, t: s.__setitem__(0, t[1]),
    "view_mul_": lambda P, s, t: s[:, 1].mul_(2),
    "index_add_": lambda P, s, t: s.index_add_(0, torch.tensor([1, 0]), t),
    "masked_fill_": lambda P, s, t: s.masked_fill_(t > 0, 1.0),
    "detach_mul_": lambda P, s, t: s.detach().mul_(2),
    "data_mul_": lambda P, s, t: s.data.mul_(2),
    "slice_sigmoid_": lambda P, s, t: s[:, :2].sigmoid_(),
    "slice_tanh_": lambda P, s, t: s[1].tanh_(),
}

# Distinct torch callables/methods exercised (what the README counts as the vocabulary size).
TORCH_OPS = sorted(set(OPS) | set(INPLACE))
