"""Random training steps for the memory differential: a model, its input batch, a forward and how the step runs.

``generate(seed)`` draws a :class:`MemProgram` (plain data, so a failing seed prints what it was);
``build(prog)`` makes it real: an ``nn.Module`` whose ``forward`` runs the steps over a pool of ``(B, D)``
tensors, the batch, the loss. Steps cover modules (Linear, LayerNorm, an MLP, a DenseNet-like ``cat`` then
``Linear``), views and reshapes, in-place writes (whole tensors and slices: ``CopySlices``), both
checkpoint flavours (over an ``nn.Sequential``, a residual block with its own ``forward``, a function with
temporaries no node saves), custom ``autograd.Function``s, reductions whose gradient is expanded; the
step: ``retain_graph``, ``.grad`` already set or not, an optimizer (first step or a later one), traced or
not. Sizes are large enough that one missed activation is more than the 4 KiB level tolerance.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.fuzz._vocab import ExpF, Square  # the custom Functions the random programs use

__all__ = ["MemProgram", "generate", "build", "Built", "OPS"]


class Residual(nn.Module):
    """A block with its own ``forward`` (a reentrant checkpoint of it is modelled only when traced)."""

    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Gated(nn.Module):
    """Temporaries no node saves: ``sigmoid(x) * x`` then ``exp``, a sum expanded back."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h = self.fc(x)
        return (torch.sigmoid(h) * h).tanh() + h.mean(-1, keepdim=True)


def _block(kind: str, d: int) -> nn.Module:
    if kind == "seq":
        return nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))
    if kind == "seq_gelu":
        return nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
    if kind == "residual":
        return Residual(d)
    return Gated(d)


BLOCKS = ("seq", "seq_gelu", "residual", "gated")


def _slice_write(m, s, t):
    y = s * 1.5
    y[:, : y.shape[1] // 2] = torch.tanh(t[:, : t.shape[1] // 2])  # CopySlices (Swin-V2's window writes)
    return y


def _cat_slice(m, s, t):
    h = s.shape[1] // 2
    return torch.cat([s[:, :h], t[:, h:]], 1)


def _view_t(m, s, t):
    b, d = s.shape
    return (s.reshape(b, 2, d // 2).transpose(1, 2) * 2).reshape(b, d)


# name -> fn(module or None, s, t). Each maps (B, D) pool tensors to a (B, D) tensor (in-place ops: None).
OPS: dict = {
    "linear": lambda m, s, t: m(s),
    "layernorm": lambda m, s, t: m(s),
    "mlp": lambda m, s, t: m(s),
    "catlinear": lambda m, s, t: m(torch.cat([s, t], 1)),  # DenseNet-like
    "ckpt": lambda m, s, t: checkpoint(m, s, use_reentrant=False),
    "ckpt_reentrant": lambda m, s, t: checkpoint(m, s, use_reentrant=True),
    "ckpt_fn": lambda m, s, t: checkpoint(lambda a, b: (torch.sigmoid(a) * b).exp() * a, s, t, use_reentrant=False),
    "gelu": lambda m, s, t: F.gelu(s),
    "tanh": lambda m, s, t: torch.tanh(s),
    "sigmoid": lambda m, s, t: torch.sigmoid(s),
    "relu": lambda m, s, t: F.relu(s),
    "exp": lambda m, s, t: torch.exp(s.clamp(max=3)),
    "softmax": lambda m, s, t: torch.softmax(s, -1),
    "dropout": lambda m, s, t: F.dropout(s, 0.1, True),
    "mul": lambda m, s, t: s * t,
    "add": lambda m, s, t: s + t,
    "mul_scalar": lambda m, s, t: s * 0.5,
    "view_t": _view_t,
    "transpose": lambda m, s, t: s.t().t(),
    "clone": lambda m, s, t: s.clone(),
    "sum_expand": lambda m, s, t: s.sum(-1, keepdim=True).expand_as(s) + t,
    "mean_mul": lambda m, s, t: s * s.mean(0, keepdim=True),
    "cat_slice": _cat_slice,
    "slice_write": _slice_write,
    "square": lambda m, s, t: Square.apply(s),
    "expf": lambda m, s, t: ExpF.apply(s.clamp(max=3)),
    "add_": lambda m, s, t: s.add_(t),
    "relu_": lambda m, s, t: s.relu_(),
    "mul_": lambda m, s, t: s.mul_(2),
    "slice_mul_": lambda m, s, t: s[:, :2].mul_(2),
}
_MODULE_OPS = {"linear", "layernorm", "mlp", "catlinear", "ckpt", "ckpt_reentrant"}
_INPLACE = {"add_", "relu_", "mul_", "slice_mul_"}
_WEIGHTS = {"linear": 4, "layernorm": 2, "mlp": 2, "catlinear": 2, "ckpt": 3, "ckpt_reentrant": 2, "ckpt_fn": 2}
LOSSES = ("sum", "mean", "square_mean", "cross_entropy", "residual_sum")
OPTIMIZERS = (None, None, "sgd", "sgd_momentum", "adamw")


@dataclass(frozen=True)
class MemProgram:
    """``steps``: ``(op, i, j, block)``; ``i``/``j`` pick pool entries modulo the pool size."""

    seed: int
    batch: int
    width: int
    steps: tuple
    loss: str
    retain_graph: bool
    grad_set: bool
    optimizer: str | None
    later_step: bool
    traced: bool
    input_grad: bool

    def source(self) -> str:
        lines = [f"  {op}({block or ''}) on pool[{i}], pool[{j}]" for op, i, j, block in self.steps]
        flags = (f"B={self.batch} D={self.width} loss={self.loss} retain_graph={self.retain_graph} "
                 f"grad_set={self.grad_set} optimizer={self.optimizer} later_step={self.later_step} "
                 f"traced={self.traced} input_grad={self.input_grad}")
        return "\n".join([f"seed {self.seed}: {flags}", *lines])


def generate(seed: int) -> MemProgram:
    """The program of ``seed`` (the same every time)."""
    rnd = random.Random(seed)
    names = list(OPS)
    weights = [_WEIGHTS.get(n, 1) for n in names]
    steps = []
    for _ in range(rnd.randint(2, 9)):
        op = rnd.choices(names, weights)[0]
        block = rnd.choice(BLOCKS) if op.startswith("ckpt") and op != "ckpt_fn" else None
        steps.append((op, rnd.randrange(16), rnd.randrange(16), block))
    optimizer = rnd.choice(OPTIMIZERS)
    grad_set = rnd.random() < 0.3
    return MemProgram(seed, rnd.choice((8, 16, 32)), rnd.choice((32, 64, 128)), tuple(steps),
                      rnd.choice(LOSSES), rnd.random() < 0.2, grad_set, optimizer,
                      optimizer is not None and grad_set and rnd.random() < 0.5, rnd.random() < 0.3,
                      rnd.random() < 0.15)


class Net(nn.Module):
    def __init__(self, prog: MemProgram):
        super().__init__()
        d = prog.width
        self.steps = prog.steps
        self.loss_kind = prog.loss
        mods: list[nn.Module] = []
        for op, _, _, block in prog.steps:
            if op == "linear":
                mods.append(nn.Linear(d, d))
            elif op == "layernorm":
                mods.append(nn.LayerNorm(d))
            elif op == "mlp":
                mods.append(_block("seq_gelu", d))
            elif op == "catlinear":
                mods.append(nn.Linear(2 * d, d))
            elif block is not None:
                mods.append(_block(block, d))
            else:
                mods.append(nn.Identity())
        self.mods = nn.ModuleList(mods)
        self.head = nn.Linear(d, d)  # every step trains something

    def forward(self, x, target):
        pool = [x]
        for (op, i, j, _), m in zip(self.steps, self.mods):
            if op in _INPLACE:  # never on the batch itself (it outlives the step)
                if len(pool) == 1:
                    continue
                i = 1 + i % (len(pool) - 1)
            s, t = pool[i % len(pool)], pool[j % len(pool)]
            out = OPS[op](m, s, t)
            if op not in _INPLACE:
                pool.append(out)
        h = self.head(pool[-1])
        if self.loss_kind == "sum":
            return h.sum()
        if self.loss_kind == "mean":
            return h.mean()
        if self.loss_kind == "square_mean":
            return (h ** 2).mean()
        if self.loss_kind == "residual_sum":  # sum()'s expanded gradient reaches AddBackward0 and the head
            return (h + pool[-1]).sum()
        return F.cross_entropy(h, target)


@dataclass
class Built:
    model: nn.Module
    inputs: list  # the batch (and the targets): alive before the forward, held by the caller
    optimizer: object

    def loss(self):
        return self.model(*self.inputs)


_OPTS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.01),
         "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
         "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3)}


def build(prog: MemProgram) -> Built:
    """The model, the batch and the optimizer of ``prog``, in the state the profiled step starts from
    (``.grad`` set and an earlier optimizer step taken when the program says so)."""
    torch.manual_seed(prog.seed)
    model = Net(prog)
    x = torch.randn(prog.batch, prog.width, requires_grad=prog.input_grad)
    target = torch.randint(0, prog.width, (prog.batch,))
    opt = _OPTS[prog.optimizer](model.parameters()) if prog.optimizer else None
    built = Built(model, [x, target], opt)
    if prog.grad_set:
        built.loss().backward()
        if prog.later_step and opt is not None:
            opt.step()
        x.grad = None
    return built
