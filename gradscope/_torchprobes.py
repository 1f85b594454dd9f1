"""The probes of :mod:`gradscope._torchcheck`'s facts: each runs the private torch API it names on tiny
tensors and returns True when torch still behaves as gradscope reads it (raises, or returns False, when not).
docs/internals.md#private-torch-facts.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

__all__ = [
    "get",
    "isolated",
    "sequence_numbers",
    "leaf_nodes",
    "saved_tensors",
    "output_metadata",
    "storage_identity",
    "version_counter",
    "descriptors",
    "module_hooks",
    "function_forward_frame",
    "engine",
    "foreach",
    "anomaly",
    "profiler_events",
    "attention",
    "compiled",
    "fsdp2",
    "fake",
    "dispatch_rules",
    "mem_tools",
]


def isolated(probe: Any) -> Any:
    """``probe()`` with grad on, outside inference mode, unseen by any TorchFunctionMode (a ``trace()`` the
    user has open, a ``torch.device`` context) and any TorchDispatchMode (a ``FakeTensorMode``): a probe
    needs its own tiny graph of real CPU tensors, whatever the caller's state, and changes nothing the
    caller records."""
    off = get("_C.DisableTorchFunction")
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        if off is not None:
            stack.enter_context(off())
        try:  # a FakeTensorMode (MemTracker's setup) would make the probe's tensors fake
            from torch.utils._python_dispatch import _disable_current_modes

            stack.enter_context(_disable_current_modes())
        except ImportError:
            pass
        return probe()


def get(dotted: str) -> Any:
    """``torch.<dotted>``, or None when a part is missing."""
    obj: Any = torch
    for part in dotted.split("."):
        try:
            obj = getattr(obj, part)
        except (AttributeError, RuntimeError):  # torch.ops raises RuntimeError for an unknown op
            return None
    return obj


def _have(*names: str) -> bool:
    missing = [n for n in names if get(n) is None]
    if missing:
        raise LookupError(f"torch.{missing[0]} is missing")
    return True


def _mul() -> Any:
    a = torch.ones(2, requires_grad=True)
    return a, a * a


def sequence_numbers() -> bool:
    _have("_C._autograd._get_sequence_nr")
    a, y = _mul()
    first = y.grad_fn._sequence_nr()
    later = (y + 1).grad_fn._sequence_nr()
    return isinstance(first, int) and later > first and torch._C._autograd._get_sequence_nr() > later


def leaf_nodes() -> bool:
    _have("_C._functions.AccumulateGrad")
    a = torch.ones(2, requires_grad=True)
    leaf: Any = torch.autograd.graph.get_gradient_edge(a).node
    return type(leaf) is get("_C._functions.AccumulateGrad") and leaf.variable is a


def saved_tensors() -> bool:
    _have("_C._autograd.SavedTensor")
    a, y = _mul()
    node: Any = y.grad_fn
    raw = node._raw_saved_self
    return isinstance(raw, torch._C._autograd.SavedTensor) and node._saved_self is a and "_saved_other" in dir(node)


def output_metadata() -> bool:
    a, y = _mul()
    return tuple(y.grad_fn._input_metadata[0].shape) == (2,)


def storage_identity() -> bool:
    _have("_C._storage_Use_Count")
    a = torch.ones(2)
    b = a.view(2)
    st = a.untyped_storage()
    same = st._cdata == b.untyped_storage()._cdata and a._cdata != b._cdata
    return same and torch._C._storage_Use_Count(st._cdata) >= 2


def version_counter() -> bool:
    a = torch.ones(2)
    before = a._version
    a.add_(1)
    sparse = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.long), torch.ones(1), (2,), check_invariants=True)
    return a._version == before + 1 and tuple(sparse._values().shape) == (1,)


def descriptors() -> bool:
    get("_C.DisableTorchFunction")()
    base = vars(torch._C.TensorBase)
    return all(type(base.get(n)).__name__ == "getset_descriptor" for n in ("data", "dtype"))


def module_hooks() -> bool:
    from torch.nn.modules import module

    # registered and removed, never called: a call would reach every hook the user registered too
    handles = [
        module.register_module_forward_pre_hook(lambda m, a: None),
        module.register_module_forward_hook(lambda m, a, o: None, always_call=True),
    ]
    for h in handles:
        h.remove()
    return all(callable(getattr(h, "remove", None)) for h in handles)


def function_forward_frame() -> bool:
    """A custom Function's ``forward`` runs as a Python frame on the caller's stack (its code is the class's
    ``forward.__code__``), whether ``Function.apply`` is a Python classmethod (to 2.14) or a builtin (2.15)."""
    here = sys._getframe()
    seen: list = []

    class _Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            f = sys._getframe()
            seen.append(f.f_code is _Probe.forward.__code__ and _on_stack(f, here))
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    _Probe.apply(torch.ones(1, requires_grad=True))
    return seen == [True]


def _on_stack(f: Any, frame: Any) -> bool:
    while f is not None and f is not frame:
        f = f.f_back
    return f is frame


def engine() -> bool:
    _have("_C._current_graph_task_id", "_C._current_autograd_node", "autograd.Variable._execution_engine")
    seen: list = []
    a, y = _mul()
    node: Any = y.grad_fn

    def names() -> tuple:
        return torch._C._current_graph_task_id(), type(torch._C._current_autograd_node()).__name__

    def pre(grads: Any) -> None:
        seen.append(names())

    def post(*_: Any) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: seen.append("end"))

    node.register_prehook(pre)
    node.register_hook(post)
    y.sum().backward()
    return seen[0][0] >= 0 and seen[0][1] == "MulBackward0" and seen[-1] == "end" and names()[0] == -1


def foreach() -> bool:
    _have("_foreach_norm", "_foreach_mul", "_foreach_sub_")
    ts = [torch.full((2,), 3.0), torch.full((1,), 4.0)]
    norms = [float(n) for n in torch._foreach_norm(ts, 2.0)]
    torch._foreach_sub_(ts, torch._foreach_mul(ts, 0.5))
    return abs(norms[0] - 18**0.5) < 1e-5 and abs(norms[1] - 4.0) < 1e-6 and float(ts[1]) == 2.0


def anomaly() -> bool:
    _have("set_anomaly_enabled", "is_anomaly_check_nan_enabled")
    return isinstance(torch.is_anomaly_check_nan_enabled(), bool)


def profiler_events() -> bool:
    """A backward under ``torch.autograd.profiler.profile(profile_memory=True)``: its node's event is
    ``autograd::engine::evaluate_function: MulBackward0`` and holds allocator events (``_EventType.Allocation``)."""
    _have("_C._autograd._profiler_enabled", "_C._profiler._EventType.Allocation")
    from torch.autograd.profiler import profile

    a = torch.ones(256, requires_grad=True)
    y = a * a
    with profile(profile_memory=True, use_kineto=True) as prof:
        y.backward(torch.ones(256))
    stack, found = list(prof.kineto_results.experimental_event_tree()), []  # type: list, list
    while stack:
        n = stack.pop()
        if n.name == "autograd::engine::evaluate_function: MulBackward0":
            found.extend(c for c in _all(n) if c.typed[0] == torch._C._profiler._EventType.Allocation)
        stack.extend(n.children)
    return any(int(e.typed[1].alloc_size) > 0 for e in found)


def _all(n: Any) -> list:
    out, stack = [], list(n.children)
    while stack:
        c = stack.pop()
        out.append(c)
        stack.extend(c.children)
    return out


def attention() -> bool:
    _have("_fused_sdp_choice", "ops.aten._scaled_dot_product_flash_attention_for_cpu")
    q = torch.ones(1, 1, 4, 8)
    return int(torch._fused_sdp_choice(q, q, q)) in (0, 1)


def compiled() -> bool:
    import torch._functorch.aot_autograd  # noqa: F401 - first, or runtime_wrappers' import is circular
    from torch._functorch._aot_autograd import runtime_wrappers as rw

    lazy = rw.AutogradLazyBackwardCompileInfo.__dataclass_fields__
    cached = rw.CachedAutogradLazyBackwardCompileInfo.__dataclass_fields__
    return "bw_module" in lazy and "bw_module_fn" in cached and "_lazy_backward_info" in _names_in(rw)


def _names_in(module: Any) -> set:
    """Every name a module's code reads or assigns (attribute names included), its functions' too."""
    import inspect

    out: set = set()
    stack = [compile(inspect.getsource(module), module.__file__, "exec")]
    while stack:
        code = stack.pop()
        out.update(code.co_names)
        stack.extend(c for c in code.co_consts if hasattr(c, "co_names"))
    return out


def fsdp2() -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group, _fsdp_state

    names = _names_in(_fsdp_state) | _names_in(_fsdp_param_group) | _names_in(_fsdp_param)
    wanted = {"_fsdp_param_groups", "fsdp_params", "_module_info", "sharded_param", "_unsharded_param", "mp_policy"}
    return callable(getattr(FSDPModule, "_get_fsdp_state", None)) and wanted <= names


def fake() -> bool:
    from torch._subclasses import fake_tensor as ft

    names = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException")
    with ft.FakeTensorMode(allow_fallback_kernels=False):
        t = torch.ones(2) * 2
    return all(hasattr(ft, n) for n in names) and isinstance(t, ft.FakeTensor)


def dispatch_rules() -> bool:
    from torch._library.simple_registry import find_torch_dispatch_rule

    return callable(find_torch_dispatch_rule)


def mem_tools() -> bool:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    return callable(MemTracker) and callable(FSDPMemTracker)
