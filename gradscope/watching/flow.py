"""Gradient flow: one batched pass gives the NaN/Inf check and the per-module gradient norms.

Per device and dtype family, ``torch._foreach_norm`` reduces every gradient to its L2 norm (NaN or Inf
exactly when the gradient holds one, or when a finite gradient's norm overflows), read with one
``stack`` + ``.tolist()`` (on the CPU, where there is no sync to save, one ``.item()`` each: cheaper than
the stack); the squares are then summed per owning module in Python floats (double precision). One read
of the gradients and one sync per group give both ``guard.history`` and the non-finite test; when every
gradient has one device and one dtype (the usual case) there is one group and no grouping loop.
Culprits are counted (exact NaN/Inf counts) only when a norm is not finite.

NOTE [norms of any dtype]
``_foreach_norm(..., dtype=torch.float32)`` refuses a float64 gradient (it would narrow) and a complex one
(a complex input needs a complex ``dtype``), and raised out of ``backward()`` for such models. Gradients
are grouped by device and by what their norm is computed in: float16, bfloat16 and float32 in float32
(one group, as ``clip_grad_norm_`` does); any other dtype (float64, complex64, complex128) in its own group
without ``dtype=``, which gives a real norm of the right precision. Sparse gradients are normed over their
stored values.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from gradscope._torch import foreach_mul, foreach_norm, foreach_sub_, sparse_values
from gradscope.watching.safety import InertCopy
from gradscope.watching.step import BadGrad, WatchedParam

__all__ = ["Flow", "UpdateRatios", "group_norms"]


def _local(g):
    to_local = getattr(g, "to_local", None)  # DTensor (FSDP2): this rank's shard
    return to_local() if callable(to_local) else g


_IN_FLOAT32 = (torch.float16, torch.bfloat16, torch.float32)


def group_norms(tensors: list[torch.Tensor]) -> list[float]:
    """The L2 norm of each tensor as a Python float, one fused call and one sync per device and dtype
    family (NOTE [norms of any dtype])."""
    keys = [(t.device, t.dtype) for t in tensors]
    if not keys or keys.count(keys[0]) == len(keys):  # one device and one dtype: the common case, one call
        return _norms(tensors, keys[0][1]) if keys else []
    groups: dict[tuple[torch.device, torch.dtype | None], list[int]] = {}
    for i, (device, dtype) in enumerate(keys):
        groups.setdefault((device, None if dtype in _IN_FLOAT32 else dtype), []).append(i)
    out = [0.0] * len(tensors)
    for (_device, family), idx in groups.items():
        for i, n in zip(idx, _norms([tensors[i] for i in idx], family)):
            out[i] = n
    return out


def _norms(ts: list[torch.Tensor], dtype: torch.dtype | None) -> list[float]:
    """One ``_foreach_norm`` over tensors of one device (in float32 for the float32 family) and one read."""
    norms = foreach_norm(ts, 2, dtype=torch.float32) if dtype is None or dtype in _IN_FLOAT32 else foreach_norm(ts, 2)
    if ts[0].device.type == "cpu":
        return [n.item() for n in norms]  # no sync to save on the CPU: cheaper than a stack
    return torch.stack(norms).tolist()


class Flow:
    """Norms per module per checked step, vanishing/exploding flags, update/weight ratios."""

    def __init__(self, params: list[WatchedParam], *, history: int, vanishing: float, exploding: float):
        self.modules = list(dict.fromkeys(wp.module for wp in params))
        self._index = {m: i for i, m in enumerate(self.modules)}
        self.history: deque = deque(maxlen=history) if history else deque(maxlen=1)
        self.keep = bool(history)
        self.steps: deque = deque(maxlen=history or 1)  # backward number of each history entry
        self.flags: deque = deque(maxlen=1000)  # (backward, module, "vanishing"/"exploding", norm)
        self.ratios: deque = deque(maxlen=history or 1)  # {module: ||update|| / ||weight||}
        self.vanishing, self.exploding = vanishing, exploding

    def add_module(self, module: str) -> None:
        """A module whose parameters are watched from now on (a layer added or replaced mid-run)."""
        if module not in self._index:
            self._index[module] = len(self.modules)
            self.modules.append(module)

    def measure(self, params: list[WatchedParam], got: list[int], backward: int, scale: float | None) -> list[BadGrad]:
        """Norms of the fresh gradients of ``params[i]`` for ``i`` in ``got``; returns those holding NaN/Inf."""
        index = self._index
        wps: list[WatchedParam] = []
        grads: list[torch.Tensor] = []
        for wp in map(params.__getitem__, got):
            g = wp.param.grad
            if g is None:
                continue
            if type(g) is not torch.Tensor:
                g = _local(g)
            if g.is_sparse:
                g = sparse_values(g)
            if g.numel():
                wps.append(wp)
                grads.append(g)
        norms = group_norms(grads)
        sums = [0.0] * len(self.modules)
        seen = [False] * len(self.modules)
        for wp, n in zip(wps, norms):
            i = index[wp.module]
            sums[i] += n * n
            seen[i] = True
        bad: list[BadGrad] = []
        if not math.isfinite(sum(norms)):
            for wp, g, n in zip(wps, grads, norms):
                if not math.isfinite(n):
                    nan, inf = int(torch.isnan(g).sum().item()), int(torch.isinf(g).sum().item())
                    if nan or inf:
                        bad.append(BadGrad(wp, nan, inf, g.numel()))
        entry = {m: math.sqrt(sums[i]) for i, m in enumerate(self.modules) if seen[i]}
        if self.keep:
            self.history.append(entry)
            self.steps.append(backward)
        unscale = scale if scale and scale > 0 else 1.0
        for m, v in entry.items():
            v /= unscale
            if v < self.vanishing:
                self.flags.append((backward, m, "vanishing", v))
            elif v > self.exploding and math.isfinite(v):
                self.flags.append((backward, m, "exploding", v))
        return bad


class UpdateRatios:
    """``||w_after - w_before|| / ||w_before||`` per module around ``optimizer.step()``, every ``every``
    steps (a copy of the parameters is taken only on those steps)."""

    def __init__(self, optimizer, params: list[WatchedParam], flow: Flow, every: int, safety):
        self._flow, self._every, self._params = flow, every, params
        self._calls = 0
        self._before: tuple[list[torch.Tensor], list[torch.Tensor], list[float]] | None = None
        self._handles = [  # NOTE [never break training], NOTE [copied modules]
            optimizer.register_step_pre_hook(InertCopy(safety.run, "update ratio", self._pre)),
            optimizer.register_step_post_hook(InertCopy(safety.run, "update ratio", self._post)),
        ]

    def _pre(self, _opt, _args, _kwargs):
        self._calls += 1
        if self._calls % self._every:  # steps every, 2*every, ...
            self._before = None
            return
        with torch.no_grad():
            tensors = [_local(wp.param.detach()) for wp in self._params]
            wn = [n * n for n in group_norms(tensors)]
            self._before = (tensors, foreach_mul(tensors, 1.0), wn)

    def _post(self, _opt, _args, _kwargs):
        if self._before is None:
            return
        tensors, before, wn = self._before
        self._before = None
        with torch.no_grad():
            foreach_sub_(before, tensors)  # in place: -(update), same norm
            dn = [n * n for n in group_norms(before)]
        del before
        num: dict = {}
        den: dict = {}
        for wp, d, w in zip(self._params, dn, wn):
            num[wp.module] = num.get(wp.module, 0.0) + d
            den[wp.module] = den.get(wp.module, 0.0) + w
        self._flow.ratios.append({m: (math.sqrt(num[m]) / math.sqrt(den[m]) if den[m] > 0 else math.inf) for m in num})

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []
