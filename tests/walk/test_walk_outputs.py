"""Output metadata taken from a saved slot (NOTE [outputs from a saved slot] in walk/outputs.py) is what
torch's ``_input_metadata`` says, on every node type the shortcut covers.

Ground truth: each node's own ``_input_metadata`` (shape, dtype, device of every output), read here
directly, and the general reader (``fast=False``), which never takes the shortcut. Inputs cover dtypes
(float32/64, bfloat16, complex), broadcast and non-contiguous views, the meta device, in-place variants,
a dtype argument (softmax), a slot written in place (version > 0: the shortcut must not be used), and a
second-order graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradscope.walk.build import build, param_names
from gradscope.walk.outputs import OUT_SLOT
from gradscope.walk.saved import dtype_str
from gradscope.walk.spec import SPECS

_REAL = (torch.float32, torch.float64, torch.bfloat16)
_COMPLEX_OK = {"ExpBackward0", "SigmoidBackward0", "TanhBackward0", "SqrtBackward0", "RsqrtBackward0",
               "ReciprocalBackward0", "TanBackward0", "SinBackward0", "CosBackward0", "LogBackward0",
               "Log2Backward0", "Log10Backward0", "Log1PBackward0", "SinhBackward0", "CoshBackward0",
               "AtanBackward0", "Expm1Backward0"}

# one forward per covered node type: name -> f(x) (x requires grad; f may use in-place ops on a copy)
_OPS = {
    "ExpBackward0": torch.exp, "Exp2Backward0": torch.exp2, "Expm1Backward0": torch.expm1,
    "ReluBackward0": torch.relu, "SigmoidBackward0": torch.sigmoid, "TanhBackward0": torch.tanh,
    "SoftmaxBackward0": lambda x: x.softmax(-1), "LogSoftmaxBackward0": lambda x: x.log_softmax(0),
    "SafeSoftmaxBackward0": lambda x: torch._safe_softmax(x, -1),
    "SqrtBackward0": torch.sqrt, "RsqrtBackward0": torch.rsqrt, "ReciprocalBackward0": torch.reciprocal,
    "TanBackward0": torch.tan, "EluBackward1": lambda x: F.elu_(x * 1), "CeluBackward1": lambda x: F.celu_(x * 1),
    "LeakyReluBackward1": lambda x: F.leaky_relu_(x * 1), "SinBackward0": torch.sin, "CosBackward0": torch.cos,
    "GeluBackward0": F.gelu, "SiluBackward0": F.silu, "LogBackward0": torch.log, "Log1PBackward0": torch.log1p,
    "Log2Backward0": torch.log2, "Log10Backward0": torch.log10, "ErfBackward0": torch.erf,
    "SinhBackward0": torch.sinh, "CoshBackward0": torch.cosh, "AtanBackward0": torch.atan,
    "HardtanhBackward0": F.hardtanh, "LeakyReluBackward0": F.leaky_relu, "SoftplusBackward0": F.softplus,
    "MishBackward0": F.mish, "HardswishBackward0": F.hardswish, "HardsigmoidBackward0": F.hardsigmoid,
}


def _inputs(dtype, device="cpu"):
    """Plain, broadcast (expanded), transposed and sliced inputs of one dtype."""
    base = torch.rand(3, 4, dtype=dtype, device=device) + 0.5
    w = base.clone().requires_grad_()
    return w, [w, w.t(), w[:, 1:3], w[:1].expand(5, 4), w.unsqueeze(0)]


def _nodes(root):
    seen, stack, out = {root.grad_fn}, [root.grad_fn], []
    while stack:
        node = stack.pop()
        out.append(node)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return out


def _truth(root) -> dict:
    """``(node name, seq) -> (device, shapes, dtypes)`` straight from torch's ``_input_metadata``."""
    out = {}
    for node in _nodes(root):
        if hasattr(node, "variable"):
            continue
        meta = node._input_metadata
        out[(type(node).__name__, node._sequence_nr())] = (
            str(meta[0].device), [list(m.shape) for m in meta], [dtype_str(m.dtype) for m in meta])
    return out


def _check(root, params, expect_short) -> None:
    names = param_names(None, params)
    truth = _truth(root)
    for fast in (True, False):
        g = build([root], names, fast=fast).digraph()
        for _, d in g.nodes(data=True):
            if d["kind"] == "op":
                assert (d["device"], d["out_shapes"], d["out_dtypes"]) == truth[(d["name"], d["seq"])], d["name"]
    assert expect_short <= {name for name, _ in truth}    # the covered node types are in the graph


def test_every_covered_type_exists_in_torch_and_saves_its_slot():
    for name, slot in OUT_SLOT.items():
        cls = getattr(torch._C._functions, name)
        assert hasattr(cls, f"_raw_saved_{slot}"), name
    assert set(OUT_SLOT) == set(_OPS)


@pytest.mark.parametrize("name", sorted(_OPS))
def test_outputs_from_a_saved_slot_are_torchs(name):
    fn = _OPS[name]
    for dtype in _REAL + ((torch.complex64,) if name in _COMPLEX_OK else ()):
        w, xs = _inputs(dtype)
        outs = []
        for x in xs:
            outs.append(fn(x).real if dtype.is_complex else fn(x))
        root = sum(o.float().sum() for o in outs)
        _check(root, {"w": w}, {name})
    # the meta device: shapes and dtypes without data
    w, xs = _inputs(torch.float32, "meta")
    root = sum(fn(x).sum() for x in xs)
    _check(root, {"w": w}, {name})
    assert SPECS[getattr(torch._C._functions, name)].out_slot == OUT_SLOT[name]   # the shortcut ran


def test_the_shortcut_is_taken_and_matches_on_a_mixed_graph():
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    y = torch.softmax(w, -1, dtype=torch.float32)          # a dtype argument: the result has it
    z = (y.sin() * torch.randn(2, 1, 6)).exp()              # broadcasting before exp
    h = F.gelu(z.transpose(0, 2)).sigmoid()
    root = h.sum() + torch.tanh(w).sum()
    names = param_names(None, {"w": w})
    short = {n for n in _truth(root) if OUT_SLOT.get(n[0])}
    assert len(short) >= 5
    _check(root, {"w": w}, {"SoftmaxBackward0", "SinBackward0", "ExpBackward0", "GeluBackward0"})
    records = build([root], names).digraph()
    assert records.number_of_nodes() == len(_nodes(root))


def test_a_slot_written_in_place_falls_back_to_input_metadata():
    w = torch.randn(3, 4, requires_grad=True)
    y = w.exp()                          # ExpBackward0 saves its result y ...
    z = y * 1.0
    with torch.no_grad():
        y.add_(1)                        # ... then written in place: version 1, stale
    root = z.sum()
    _check(root, {"w": w}, {"ExpBackward0"})
    x = torch.randn(2, 5, requires_grad=True)
    s = x.sin()
    x2 = x.detach()
    x2.mul_(2)                           # the saved input is now stale too: the general reader
    _check(s.sum(), {"x": x}, {"SinBackward0"})


def test_second_order_graph_outputs_match():
    x = torch.randn(3, 3, requires_grad=True)
    y = x.tanh().exp().sum()
    (gx,) = torch.autograd.grad(y, x, create_graph=True)
    _check(gx.sin().sum(), {"x": x}, {"SinBackward0"})
