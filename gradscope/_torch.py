"""Every private torch API gradscope relies on, in one file to audit on a torch upgrade.

Each entry says what it is and which torch fact it relies on: a section of docs/internals.md (observed on
torch 2.13.0), each checked by a named test. Nothing else in gradscope may touch ``torch._C``, a node's
``_saved_*`` / ``_raw_saved_*`` / ``_sequence_nr`` / ``_input_metadata`` / ``_forward_cls``, a storage's
``_cdata`` or the ``nn.Module`` hook globals directly. (The walk, ``gradscope/walk/``, still has its own
copies of some of these in its hot loop; they are listed in docs/architecture.md until it routes them here.)

When torch changes one of these, fix it here and run ``tests/`` (the facts each entry relies on are what
the tests check against torch itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradscope._torchcheck import WALK, read, readable, require

__all__ = ["fsdp2_groups", "peek_sequence_nr", "sequence_nr", "NO_SEQUENCE_NR", "ACCUMULATE_GRAD",
           "SAVED_TENSOR", "SAVED_PREFIX", "RAW_SAVED_PREFIX", "input_metadata", "forward_cls", "storage_key",
           "version", "TENSOR_DATA", "register_module_forward_pre_hook", "require", "TRACE_FACTS",
           "register_module_forward_hook", "current_graph_task_id", "current_autograd_node",
           "queue_engine_callback", "foreach_norm", "is_checkpoint_holder", "sparse_values",
           "storage_key_and_bytes", "foreach_mul", "foreach_sub_", "anomaly_state", "set_anomaly",
           "on_next_backward", "cancel_next_backward", "profiler_enabled", "PROFILER_ALLOCATION", "func_key",
           "resolve_func", "no_torch_function", "sdp_choice", "SDPA_KEY", "cpu_flash_attention",
           "fake_tensor_mode", "fsdp2_mp_policy"]  # fmt: skip

# Every read below goes through ``_torchcheck.read``: a name this torch lacks gives a stand-in that raises
# its fact's sentence when used (never at import); features ask ``require``/``readable`` first.

TRACE_FACTS = (*WALK, "module-hooks", "tensor-descriptors", "function-forward-frame")  #: what trace() reads

# -- sequence numbers (forward creation order) -----------------------------------------------------
#: ``torch._C._autograd._get_sequence_nr()``: the next autograd sequence number of this thread, peeked
#: without using it (a no_grad op does not advance it). docs/internals.md#sequence-numbers and
#: #module-attribution-by-sequence-ranges.
peek_sequence_nr: Callable[[], int] = read("_C._autograd._get_sequence_nr", "sequence-numbers")

#: ``node._sequence_nr()`` of an AccumulateGrad node (UINT64_MAX): leaves have no creation order.
#: docs/internals.md#accumulategrad-leaves.
NO_SEQUENCE_NR = 2**64 - 1


def sequence_nr(node: Any) -> int:
    """``node._sequence_nr()``: the node's creation order, per thread (docs/internals.md#sequence-numbers:
    every edge points to a node with a smaller number)."""
    return node._sequence_nr()


# -- node classes and saved slots ------------------------------------------------------------------
#: ``torch._C._functions.AccumulateGrad``: the class of the leaf nodes (``type(node) is ...``);
#: ``node.variable`` is the leaf tensor. docs/internals.md#accumulategrad-leaves.
ACCUMULATE_GRAD: Any = read("_C._functions.AccumulateGrad", "leaf-nodes")

#: ``torch._C._autograd.SavedTensor``: what ``node._raw_saved_<slot>`` returns; ``.data`` reads the
#: stored tensor without a version check or an unpack hook. docs/internals.md#raw-saved-tensors.
SAVED_TENSOR: type = read("_C._autograd.SavedTensor", "saved-tensors")

#: ``node._saved_<slot>``: every saved value of a generated node (raises on a freed or stale tensor);
#: ``node._raw_saved_<slot>``: only the tensor slots. docs/internals.md#saved-attribute-names.
SAVED_PREFIX = "_saved_"
RAW_SAVED_PREFIX = "_raw_saved_"


def input_metadata(node: Any) -> tuple:
    """``node._input_metadata``: shape/dtype/device of each forward output, readable after backward and
    without keeping a tensor alive. docs/internals.md#output-metadata."""
    return node._input_metadata


def forward_cls(node: Any) -> type | None:
    """``node._forward_cls``: the ``autograd.Function`` subclass of a custom node (None for generated
    nodes); tells checkpoint (``CheckpointFunction``) and ``torch.compile`` (``CompiledFunction``) apart.
    docs/internals.md#custom-functions."""
    return getattr(node, "_forward_cls", None)


def is_checkpoint_holder(value: Any) -> bool:
    """True for ``torch.utils.checkpoint._Holder``, what ``raw.data`` holds for a slot that
    ``checkpoint(use_reentrant=False)`` recomputes (reading the slot would re-run the forward).
    docs/internals.md#non-reentrant-checkpoint."""
    return type(value).__name__ == "_Holder"


# -- tensors ---------------------------------------------------------------------------------------
def storage_key(t: torch.Tensor) -> int:
    """``t.untyped_storage()._cdata``: the StorageImpl pointer, which tells storages apart on every device,
    ``meta`` included (where ``data_ptr()`` is 0 for every tensor). docs/internals.md#storage-identity."""
    return t.untyped_storage()._cdata


def storage_key_and_bytes(t: torch.Tensor) -> tuple[int, int]:
    """``(storage_key(t), t.untyped_storage().nbytes())`` with one ``untyped_storage()`` call (the bytes
    a storage holds, counted once per key). docs/internals.md#storage-identity."""
    st = t.untyped_storage()
    return st._cdata, st.nbytes()


def impl_key(t: torch.Tensor) -> int:
    """``t._cdata``: the TensorImpl pointer (with ``id(t)``, tells a tensor from a later one that reuses
    its id without holding any reference, not even a weak one: ``torch.utils.swap_tensors``, behind
    ``module.to()`` in swap mode and FSDP2's DTensor parameters, refuses a tensor that has a weak
    reference)."""
    return t._cdata


def version(t: torch.Tensor) -> int:
    """``t._version``: the tensor's in-place version counter (raises RuntimeError on inference tensors).
    docs/internals.md#in-place-writes-and-versions."""
    return t._version


#: ``torch._C.TensorBase.__dict__["data"]``: the ``.data`` property; a TorchFunctionMode sees ``x.data``
#: as ``func.__name__ == "__get__"`` with ``func.__self__`` this descriptor.
#: docs/internals.md#the-data-property-in-a-torchfunctionmode.
_TENSOR_BASE: Any = read("_C.TensorBase", "tensor-descriptors")
TENSOR_DATA: Any = vars(_TENSOR_BASE).get("data")
TENSOR_DTYPE: Any = vars(_TENSOR_BASE).get("dtype")  #: ``.dtype``, the same way (docs/internals.md#dtype-flow)

# -- torch functions by name (a traced reentrant region's calls, replayed on ``meta``) -----------------


def func_key(func: Any) -> tuple | None:
    """A plain-data name for a function a ``TorchFunctionMode`` received, that :func:`resolve_func` turns
    back into it: ``("g", attr)`` a ``torch._C.TensorBase`` property getter (``x.T``), ``("d", name)`` a
    ``TensorBase`` method, ``("m", module, qualname)`` anything reachable from a torch module. None when
    the name does not lead back to the same function (a lambda, a bound method, a user function)."""
    name = getattr(func, "__name__", None)
    owner = getattr(func, "__self__", None)
    if name == "__get__" and type(owner).__name__ == "getset_descriptor":
        attr = getattr(owner, "__name__", None)
        return ("g", attr) if attr and _TENSOR_BASE.__dict__.get(attr) is owner else None
    if getattr(func, "__objclass__", None) is _TENSOR_BASE and isinstance(name, str):
        return ("d", name) if _TENSOR_BASE.__dict__.get(name) is func else None
    module, qual = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    if isinstance(module, str) and isinstance(qual, str) and module.split(".")[0] == "torch":
        if qual.startswith("_VariableFunctionsClass."):  # torch.add and the other ``torch.*`` ops
            qual = qual.split(".", 1)[1]
        key = ("m", module, qual)
        try:
            return key if resolve_func(key) is func else None
        except (AttributeError, TypeError):
            return None
    return None


def resolve_func(key) -> Any:
    """The function :func:`func_key` named (raises AttributeError for a name torch no longer has)."""
    kind = key[0]
    if kind == "g":
        return _TENSOR_BASE.__dict__[key[1]].__get__
    if kind == "d":
        return _TENSOR_BASE.__dict__[key[1]]
    obj: Any = torch
    for part in [*key[1].split(".")[1:], *key[2].split(".")]:
        obj = getattr(obj, part)
    return obj


#: ``F.scaled_dot_product_attention`` as :func:`func_key` names it.
SDPA_KEY = ("m", "torch._C._nn", "scaled_dot_product_attention")


def sdp_choice(args, kwargs) -> int | None:
    """``torch._fused_sdp_choice(...)`` for an ``F.scaled_dot_product_attention`` call: the kernel it picks
    from the arguments' metadata (0 math, 1 flash: on CPU ``_scaled_dot_product_flash_attention_for_cpu``,
    whose single backward node saves the output and logsumexp); ``meta`` always answers math. None when
    torch refuses the arguments. Reads metadata only. docs/internals.md#attention-kernel-choice."""
    try:
        return int(torch._fused_sdp_choice(*args, **kwargs))
    except (RuntimeError, TypeError, ValueError):
        return None


def cpu_flash_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """What ``F.scaled_dot_product_attention`` runs on CPU when :func:`sdp_choice` is flash, for ``meta``
    tensors: a boolean mask turned into an additive one (``convert_boolean_attn_mask``), then
    ``aten._scaled_dot_product_flash_attention_for_cpu``'s output (it takes grouped-query heads as they are)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), 0.0).to(query.dtype)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if query.dim() == 3:  # torch 2.15 runs 3-d inputs on the flash kernel too, unsqueezed to 4-d and back
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        return op(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0].squeeze(0)
    return op(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


#: ``torch._C.DisableTorchFunction()``: a context in which no TorchFunctionMode (a ``gradscope.trace()``
#: the user has open, say) sees the calls gradscope itself makes.
no_torch_function: Callable[[], Any] = read("_C.DisableTorchFunction", "tensor-descriptors")


# -- module hooks ----------------------------------------------------------------------------------
#: Global forward (pre-)hooks on every ``nn.Module`` call, from ``torch.nn.modules.module`` (documented
#: there, not re-exported by ``torch.nn``); both return a removable handle.
#: docs/internals.md#module-attribution-by-sequence-ranges.
register_module_forward_pre_hook = read("nn.modules.module.register_module_forward_pre_hook", "module-hooks")
register_module_forward_hook = read("nn.modules.module.register_module_forward_hook", "module-hooks")

# -- the autograd engine (during backward) ---------------------------------------------------------
#: ``torch._C._current_graph_task_id()``: the id of the running backward, -1 outside backward.
#: docs/internals.md#during-backward.
current_graph_task_id: Callable[[], int] = read("_C._current_graph_task_id", "engine-during-backward")

#: ``torch._C._current_autograd_node()``: the node the engine is running, None outside backward.
#: docs/internals.md#during-backward.
current_autograd_node: Callable[[], Any] = read("_C._current_autograd_node", "engine-during-backward")


def queue_engine_callback(fn: Callable[[], None]) -> None:
    """``torch.autograd.Variable._execution_engine.queue_callback(fn)``: run ``fn`` once when the current
    backward finishes (what DDP uses). Only valid during backward. docs/internals.md#during-backward."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


#: ``torch._foreach_norm(tensors, ord, dtype=)``: one fused norm per tensor (what
#: ``torch.nn.utils.clip_grad_norm_`` uses).
#: docs/internals.md#fused-foreach-ops-and-sparse-values; watch() calls it once per device
#: on each step's gradients, and tests/watch/test_watch_flow.py checks its norms against ``vector_norm``.
foreach_norm: Callable[..., Any] = read("_foreach_norm", "foreach-ops")

#: ``torch._foreach_mul(tensors, scalar)`` (new tensors) and ``torch._foreach_sub_(tensors, others)`` (in
#: place): fused elementwise ops over a list, what the foreach optimizers use; watch() copies the weights
#: and takes the update with them around ``optimizer.step()``. docs/internals.md#fused-foreach-ops-and-sparse-values;
#: tests/watch/test_watch_flow.py checks the update/weight ratios they give against a plain computation.
foreach_mul: Callable[..., Any] = read("_foreach_mul", "foreach-ops")
foreach_sub_: Callable[..., Any] = read("_foreach_sub_", "foreach-ops")


#: ``torch._C._autograd._profiler_enabled()``: whether a torch.profiler session is running on this thread
#: (the in-node memory measurement, memory/kernels/measure.py, runs its own session only when not).
profiler_enabled: Callable[[], bool] = read("_C._autograd._profiler_enabled", "profiler-events")

#: ``torch._C._profiler._EventType.Allocation``: the tag of an allocator event in
#: ``prof.profiler.kineto_results.experimental_event_tree()`` (``node.typed == (tag, event)``, the event's
#: ``alloc_size`` negative for a free). memory/kernels/measure.py sums them in time order for a node's in-node memory.
PROFILER_ALLOCATION: Any = read("_C._profiler._EventType.Allocation", "profiler-events")


def fake_tensor_mode() -> tuple[Any, tuple]:
    """``(FakeTensorMode(allow_fallback_kernels=False), refusals)`` from ``torch._subclasses.fake_tensor``:
    tensors made in it are fake (metadata, no data, no memory), ops run their meta kernels, an op without one
    raises (no real run on zeros); ``refusals``: what it raises for a value read (``.item()``, a tensor in an
    ``if``), a value-dependent shape, an op with no fake kernel. ``(None, ())`` on a torch without it.
    memory/kernels/fake.py; docs/internals.md#custom-function-backwards-on-fake-tensors."""
    if readable("fake-tensors") is not None:
        return None, ()
    try:
        from torch._subclasses import fake_tensor as ft

        names = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException")
        return ft.FakeTensorMode(allow_fallback_kernels=False), tuple(getattr(ft, n) for n in names)
    except (ImportError, AttributeError, TypeError):
        return None, ()


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """``t._values()``: the stored values of a sparse COO tensor, coalesced or not (``values()`` refuses
    an uncoalesced one). docs/internals.md#fused-foreach-ops-and-sparse-values."""
    return t._values()


# -- anomaly mode and the next backward (watch()'s armed step) -------------------------------------
def anomaly_state() -> tuple[bool, bool]:
    """``(torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())``, to restore later."""
    return torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()


def set_anomaly(state: tuple[bool, bool]) -> None:
    """``torch.set_anomaly_enabled(enabled, check_nan)``: anomaly mode without the Python context manager
    (no warning, no stack); in ``torch.__all__`` but undocumented (the binding ``detect_anomaly`` uses).
    With it on, each new node records its forward traceback in ``node.metadata['traceback_']``; watch()
    switches it on, with ``check_nan`` off, for one armed forward. docs/internals.md#anomaly-mode."""
    torch.set_anomaly_enabled(*state)


# ``torch.autograd._engine_run_backward(t_outputs, ...)``: the function ``backward()`` and
# ``torch.autograd.grad`` look up in ``torch.autograd`` to run the engine, its first argument the roots.
# Wrapped for one call only, then unwrapped before the engine runs (watch()'s armed backward).
# docs/internals.md#during-backward;
# tests/watch/test_watch_nan.py checks the wrap, the hand-over and the unwrap.
_waiting: list = []  # callbacks for the next backward's roots
_installed: list = []  # [(wrapper, the function it replaced)] while wrapped


def _make_wrapper(original):
    def run_backward(t_outputs, *args, **kwargs):
        _unwrap()
        for fn in _waiting[:]:
            _waiting.remove(fn)
            try:
                fn(t_outputs)
            except Exception:  # noqa: BLE001 - diagnostics must never break the user's backward
                pass
        return original(t_outputs, *args, **kwargs)

    return run_backward


def _unwrap() -> None:
    while _installed:
        wrapper, original = _installed.pop()
        if torch.autograd._engine_run_backward is wrapper:  # else someone wrapped over us: stay a pass-through
            torch.autograd._engine_run_backward = original


def on_next_backward(fn: Callable[[Any], None]) -> None:
    """Call ``fn(roots)`` at the start of the next ``backward()``/``autograd.grad`` on any thread."""
    if fn not in _waiting:
        _waiting.append(fn)
    if not _installed and getattr(torch.autograd, "_engine_run_backward", None) is not None:
        wrapper = _make_wrapper(torch.autograd._engine_run_backward)
        _installed.append((wrapper, torch.autograd._engine_run_backward))
        torch.autograd._engine_run_backward = wrapper


def cancel_next_backward(fn: Callable[[Any], None]) -> None:
    """Forget ``fn``; unwrap when no callback is left waiting."""
    if fn in _waiting:
        _waiting.remove(fn)
    if not _waiting:
        _unwrap()


def fsdp2_groups(module) -> list:
    """``fully_shard(module)``'s parameter groups, each with ``(module, attribute, sharded parameter, unsharded
    parameter or None)`` per parameter: docs/internals.md#fsdp2s-settings-on-a-wrapped-model."""
    require("fsdp2-internals")
    out = []
    for g in module._get_fsdp_state()._fsdp_param_groups:
        info = [(fp._module_info, fp.sharded_param, getattr(fp, "_unsharded_param", None)) for fp in g.fsdp_params]
        out.append((g, [(i.module, i.param_name, sharded, unsharded) for i, sharded, unsharded in info]))
    return out


def fsdp2_mp_policy(group) -> Any:
    """The ``MixedPrecisionPolicy`` of an FSDP2 parameter group: ``group.mp_policy`` up to torch 2.14; from
    2.15 each ``FSDPParam`` holds its own (the group's, or one resolved for that parameter): the first's.
    docs/internals.md#fsdp2s-settings-on-a-wrapped-model."""
    policy = getattr(group, "mp_policy", None)
    if policy is None:
        params = getattr(group, "fsdp_params", None) or ()
        policy = getattr(params[0], "mp_policy", None) if params else None
    return policy
