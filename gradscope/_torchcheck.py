"""Is this torch one gradscope can run on? Each private torch API ``gradscope/_torch.py`` uses, checked once
when ``_torch.py`` is first imported.

setup.cfg admits every torch from 2.13 on (no upper pin, so ``pip install gradscope`` keeps the user's
torch); private APIs can change in any release, so a torch that lacks one gets
:class:`~gradscope.errors.UnsupportedTorchError` naming it, at import, instead of an ``AttributeError``
deep inside a walk. ``tests/walk/test_torch_support.py`` removes one in a subprocess and reads the message.
"""

from __future__ import annotations

from typing import Any

import torch

from gradscope.errors import UnsupportedTorchError

__all__ = ["check_torch", "REQUIRED", "SUPPORTED"]

#: The torch releases gradscope is tested on (docs/internals.md records their facts).
SUPPORTED = "2.13"

#: Dotted names under ``torch`` that ``_torch.py`` reads; each must exist.
REQUIRED = (
    "_C._autograd._get_sequence_nr",
    "_C._functions.AccumulateGrad",
    "_C._autograd.SavedTensor",
    "_C._autograd._profiler_enabled",
    "_C._profiler._EventType.Allocation",
    "_C.TensorBase",
    "_C.DisableTorchFunction",
    "_C._current_graph_task_id",
    "_C._current_autograd_node",
    "autograd.Variable._execution_engine.queue_callback",
    "autograd.function.Function.apply",
    "nn.modules.module.register_module_forward_pre_hook",
    "nn.modules.module.register_module_forward_hook",
    "_foreach_norm",
    "_foreach_mul",
    "_foreach_sub_",
    "_fused_sdp_choice",
    "ops.aten._scaled_dot_product_flash_attention_for_cpu",
    "set_anomaly_enabled",
    "is_anomaly_check_nan_enabled",
)

#: Attributes of a node and a tensor of a one-op graph ``(a * a)``: what the walk reads on every node.
NODE_ATTRS = ("_sequence_nr", "_input_metadata", "_raw_saved_self", "_saved_self")
TENSOR_ATTRS = ("_cdata", "_version", "_values")


def _refuse(name: str) -> UnsupportedTorchError:
    return UnsupportedTorchError(
        f"gradscope needs torch.{name}, which torch {torch.__version__} does not have: gradscope supports "
        f"torch {SUPPORTED} (pip install 'torch=={SUPPORTED}.*'), or upgrade gradscope to a release that "
        f"supports torch {torch.__version__}."
    )


def _get(obj: Any, dotted: str) -> Any:
    """``torch.<dotted>``, or None when a part is missing."""
    for part in dotted.split("."):
        try:
            obj = getattr(obj, part)
        except (AttributeError, RuntimeError):  # torch.ops raises RuntimeError for an unknown op
            return None
    return obj


def check_torch() -> None:
    """Raise :class:`UnsupportedTorchError` naming the first private torch API this torch lacks."""
    for name in REQUIRED:
        if _get(torch, name) is None:
            raise _refuse(name)
    if "data" not in vars(_get(torch, "_C.TensorBase")):
        raise _refuse("_C.TensorBase.__dict__['data']")
    a = torch.ones(1, requires_grad=True)
    node = (a * a).grad_fn
    for attr in NODE_ATTRS:
        if _get(node, attr) is None:
            raise _refuse(f"autograd.graph.Node.{attr} (MulBackward0.{attr})")
    if _get(a.untyped_storage(), "_cdata") is None:
        raise _refuse("UntypedStorage._cdata")
    for attr in TENSOR_ATTRS:
        if _get(a, attr) is None:
            raise _refuse(f"Tensor.{attr}")
