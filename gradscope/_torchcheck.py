"""The private torch gradscope relies on, one fact per entry, each with a probe that runs at first use.

Importing gradscope never fails on a torch that moved a private attribute: ``gradscope/_torch.py`` reads
each name with :func:`read`, which gives a stand-in when it is missing. The feature that needs a fact asks
:func:`require` (a clear :class:`~gradscope.errors.UnsupportedTorchError`, a ``RuntimeError``) or
:func:`readable` (a sentence for a labelled "not measured" number or finding) before it relies on it; each
answer says which fact is not readable on this torch and what still works. A probe runs once per process,
on tiny tensors, against torch itself. ``tests/walk/test_torch_support.py`` runs every probe on the
installed torch and removes facts in a fresh process. The facts: docs/internals.md#private-torch-facts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradscope import _torchprobes as p
from gradscope.errors import UnsupportedTorchError

__all__ = ["Fact", "FACTS", "SUPPORTED", "read", "readable", "require", "probe_all", "WALK"]

#: The torch releases gradscope is tested on (docs/verification.md has each one's results).
SUPPORTED = "2.13 to 2.15"

#: What still works when a fact the walk needs is missing: nothing that walks a live graph.
_OFFLINE = "gradscope.load(), gradscope.diff() and the CLI on saved .json graphs still work"


@dataclass(frozen=True)
class Fact:
    """One private torch fact: the names it reads, the feature that needs it, what still works without it."""

    key: str
    reads: str
    needs: str
    still: str
    probe: Callable[[], Any]  # raises, or returns False, when the fact does not hold on this torch


_WALK_NEEDS = "inspect(), trace() and watch() (every walk of a live graph)"
FACTS: dict[str, Fact] = {f.key: f for f in (
    Fact("sequence-numbers", "torch._C._autograd._get_sequence_nr(), Node._sequence_nr()", _WALK_NEEDS,
         _OFFLINE, p.sequence_numbers),
    Fact("leaf-nodes", "torch._C._functions.AccumulateGrad (its .variable)", _WALK_NEEDS, _OFFLINE, p.leaf_nodes),
    Fact("saved-tensors", "Node._saved_<slot>, Node._raw_saved_<slot>, torch._C._autograd.SavedTensor (.data)",
         _WALK_NEEDS, _OFFLINE, p.saved_tensors),
    Fact("output-metadata", "Node._input_metadata", _WALK_NEEDS, _OFFLINE, p.output_metadata),
    Fact("storage-identity", "UntypedStorage._cdata, Tensor._cdata, torch._C._storage_Use_Count",
         _WALK_NEEDS, _OFFLINE, p.storage_identity),
    Fact("version-counter", "Tensor._version, Tensor._values()", _WALK_NEEDS, _OFFLINE, p.version_counter),
    Fact("tensor-descriptors", "torch._C.TensorBase.__dict__['data'|'dtype'] (getset descriptors), "
         "torch._C.DisableTorchFunction",
         "trace()'s .data cuts and dtype flow", "inspect() and watch() still work", p.descriptors),
    Fact("module-hooks", "torch.nn.modules.module.register_module_forward_pre_hook, register_module_forward_hook",
         "trace()'s module names", "inspect() and watch() still work", p.module_hooks),
    Fact("function-forward-frame", "Function.apply's frame: a custom Function's forward on the caller's stack",
         "trace()'s cuts and writes inside custom Functions", "inspect() and watch() still work",
         p.function_forward_frame),
    Fact("engine-during-backward", "torch._C._current_graph_task_id(), torch._C._current_autograd_node(), "
         "Variable._execution_engine.queue_callback()", "watch()", "inspect() and trace() still work", p.engine),
    Fact("foreach-ops", "torch._foreach_norm, torch._foreach_mul, torch._foreach_sub_",
         "watch()'s gradient norms and update ratios", "inspect() and trace() still work", p.foreach),
    Fact("anomaly-mode", "torch.set_anomaly_enabled(enabled, check_nan), torch.is_anomaly_check_nan_enabled()",
         "watch()'s armed step (the forward line of a NaN)", "inspect() and trace() still work", p.anomaly),
    Fact("profiler-events", "torch._C._autograd._profiler_enabled(), torch._C._profiler._EventType.Allocation, "
         "'autograd::engine::evaluate_function: <Node>' events", "backward_memory()'s measured in-node memory",
         "the saved tensors and gradients are still counted; in-node memory is labelled not measured",
         p.profiler_events),
    Fact("attention-kernel", "torch._fused_sdp_choice, aten._scaled_dot_product_flash_attention_for_cpu",
         "the memory model of F.scaled_dot_product_attention on CPU",
         "inspect(), trace() and memory of models without attention still work", p.attention),
    Fact("compiled-regions", "CompiledFunction._lazy_backward_info (.bw_module, .bw_module_fn())",
         "which inputs of a torch.compile region get no gradient", "the region is drawn as one node", p.compiled),
    Fact("fsdp2-internals", "FSDPModule._get_fsdp_state()._fsdp_param_groups, FSDPParamGroup.fsdp_params, "
         "FSDPParam (._module_info, .sharded_param, ._unsharded_param, .mp_policy)",
         "inspect(model=)'s FSDP2 settings for what_if()", "what_if(shard=FSDP(...)) still works", p.fsdp2),
    Fact("fake-tensors", "torch._subclasses.fake_tensor.FakeTensorMode", "memory of custom Function backwards",
         "their in-node memory is labelled not measured", p.fake),
    Fact("dispatch-rules", "torch._library.simple_registry.find_torch_dispatch_rule",
         "what a CopySlices node hides (an in-place write on a slice)", "the node is read as one op",
         p.dispatch_rules),
    Fact("distributed-tools", "torch.distributed._tools.mem_tracker.MemTracker, fsdp2_mem_tracker.FSDPMemTracker",
         "bench/'s baselines (not the package)", "the package does not use them", p.mem_tools),
)}  # fmt: skip

#: The facts every walk of a live graph needs (``inspect()``, ``trace()``'s annotate, ``watch()``'s checks).
WALK = ("sequence-numbers", "leaf-nodes", "saved-tensors", "output-metadata", "storage-identity", "version-counter")

_ANSWERS: dict[str, str | None] = {}  # fact -> None (holds) or why not, once per process


def _sentence(fact: Fact, why: str) -> str:
    return (
        f"{fact.needs} is not readable on torch {torch.__version__}: it needs {fact.reads} ({why}); "
        f"{fact.still} (gradscope is tested on torch {SUPPORTED})"
    )


def readable(key: str) -> str | None:
    """None when fact ``key`` holds on this torch, else one sentence: what is not readable on this torch,
    the private names, why, and what still works. The probe runs once per process."""
    if key not in _ANSWERS:
        fact = FACTS[key]
        try:
            ok, why = bool(p.isolated(fact.probe)), "its probe gave another answer"
        except Exception as e:  # noqa: BLE001 - any failure of a private API is "not readable"
            ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}".rstrip(": ")
        _ANSWERS[key] = None if ok else _sentence(fact, why)
    return _ANSWERS[key]


def require(*keys: str) -> None:
    """Raise :class:`UnsupportedTorchError` (one sentence) for the first of ``keys`` this torch lacks."""
    for key in keys:
        why = readable(key)
        if why is not None:
            raise UnsupportedTorchError(why)


def probe_all() -> dict[str, str | None]:
    """Every fact's answer on this torch (:func:`readable`)."""
    return {key: readable(key) for key in FACTS}


class _Missing:
    """What :func:`read` gives for a missing name: calling it raises the fact's sentence."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        require(self.key)
        raise UnsupportedTorchError(_sentence(FACTS[self.key], "a name it reads is missing"))


def read(dotted: str, key: str) -> Any:
    """``torch.<dotted>``, or a stand-in that raises fact ``key``'s sentence when called (never at import)."""
    value = p.get(dotted)
    return _Missing(key) if value is None else value
