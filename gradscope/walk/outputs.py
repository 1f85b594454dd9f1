"""NOTE [outputs from a saved slot]
``_input_metadata`` costs ~1.2 us a node (the tuple, then shape, dtype and device each through
pybind11), more than the rest of a plain node. For the node types below, one saved slot already has
the single output's shape, dtype and device, so the fast path of ``loop.py`` takes them from it:
- ``result``: the forward output itself, of an op with one output (torch names a multi-output op's
  saved outputs ``result0``, ``result1``, ...; only the listed types are trusted);
- ``self`` of a unary elementwise op that keeps the dtype (a float or complex input: only those
  require grad): the output has the input's shape, dtype and device.
Only a slot read whole by the fast path at version 0 is used (an in-place ``set_``/``resize_`` would
bump it; a hooked slot never gets there); everything else reads ``_input_metadata``. The general
reader always reads it, so tests/walk/test_compact.py (fast vs general on every test graph) and
tests/walk/test_walk_outputs.py check each type against torch.
"""

from __future__ import annotations

__all__ = ["OUT_SLOT"]

#: node type name -> the saved slot that has its one output's shape, dtype and device
OUT_SLOT = dict.fromkeys(
    (
        "ExpBackward0 Exp2Backward0 Expm1Backward0 ReluBackward0 SigmoidBackward0 TanhBackward0 "
        "SoftmaxBackward0 LogSoftmaxBackward0 SafeSoftmaxBackward0 SqrtBackward0 RsqrtBackward0 "
        "ReciprocalBackward0 TanBackward0 EluBackward1 CeluBackward1 LeakyReluBackward1"
    ).split(),
    "result",
)
OUT_SLOT.update(
    dict.fromkeys(
        (
            "SinBackward0 CosBackward0 GeluBackward0 SiluBackward0 LogBackward0 Log1PBackward0 "
            "Log2Backward0 Log10Backward0 ErfBackward0 SinhBackward0 CoshBackward0 AtanBackward0 "
            "HardtanhBackward0 LeakyReluBackward0 SoftplusBackward0 MishBackward0 HardswishBackward0 "
            "HardsigmoidBackward0"
        ).split(),
        "self",
    )
)
