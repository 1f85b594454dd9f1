"""New leaves made in the forward: ``nn.Parameter(computed)`` inside ``forward``.

NOTE [new leaves made in the forward]
``nn.Parameter(t)`` wraps ``t``'s storage in a new leaf with ``Tensor._make_subclass``, which runs in C:
no ``TorchFunctionMode`` sees it, and the graph that made ``t`` ends there (``torch.nn.Parameter(w.clone())``
or ``nn.Parameter(self.a(x))`` gives ``a`` no gradient). While a trace records, ``nn.Parameter.__new__``
is wrapped: the wrapper calls torch's own ``__new__`` unchanged and, when the wrapped tensor required
grad, records a cut at the user's line (kind ``detach``, op ``Parameter``) whose result is followed as
any cut's is (NOTE [where a cut joins]). Only the calls on a recording thread are recorded; the original
``__new__`` is back when the last trace exits. A tensor subclass takes torch's other path
(``data.detach()``), which the mode records as a plain detach at the same line.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from gradscope.tracing.modes import CutMode

__all__ = ["LeafMode"]

_Parameter = torch.nn.Parameter
_ORIGINAL: Any = _Parameter.__dict__["__new__"]  # a staticmethod
_active: list[tuple[int, LeafMode]] = []  # (thread id, mode) of the recording traces
_get_ident = threading.get_ident


def _new(cls, data=None, requires_grad=True):
    out = _ORIGINAL.__func__(cls, data, requires_grad)
    if _active and (type(data) is torch.Tensor or type(data) is _Parameter):
        tid = _get_ident()
        for t, mode in list(_active):
            if t == tid:
                mode.new_leaf(data, out)
    return out


_WRAPPED = staticmethod(_new)


class LeafMode(CutMode):
    """:class:`CutMode` that also records ``nn.Parameter(t)`` of a tensor with a graph (NOTE above)."""

    def __enter__(self):
        out = super().__enter__()
        if not _active:
            _Parameter.__new__ = _WRAPPED  # type: ignore[method-assign]
        _active.append((_get_ident(), self))
        return out

    def __exit__(self, *exc):
        _active[:] = [(t, m) for t, m in _active if m is not self]
        if not _active and _Parameter.__dict__.get("__new__") is _WRAPPED:
            _Parameter.__new__ = _ORIGINAL  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def new_leaf(self, data, out) -> None:
        try:
            if data.requires_grad:
                self._record("detach", "Parameter", [data], out=out)
        except Exception:  # noqa: BLE001 - NOTE [never change the program]
            self.rec.drop_event()
