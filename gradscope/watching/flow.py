"""Gradient flow: one batched pass gives the NaN/Inf check and the per-module gradient norms.

Per device, ``torch._foreach_norm`` reduces every gradient to its float32 L2 norm (NaN or Inf exactly when
the gradient holds one, or when a finite gradient's norm overflows float32), read with one ``.tolist()``;
the squares are then summed per owning module in Python floats (double precision). One read of the
gradients and one sync per device give both ``guard.history`` and the non-finite test, in three torch calls
whatever the number of parameters (the fixed cost that shows on sub-millisecond steps). Culprits are
counted (exact NaN/Inf counts) only when a norm is not finite.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from gradscope._torch import foreach_mul, foreach_norm, foreach_sub_, sparse_values
from gradscope.watching.step import BadGrad, WatchedParam

__all__ = ["Flow"]


def _local(g):
    to_local = getattr(g, "to_local", None)  # DTensor (FSDP2): this rank's shard
    return to_local() if callable(to_local) else g


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

    def measure(self, got: list[WatchedParam], backward: int, scale: float | None) -> list[BadGrad]:
        """Norms of the fresh gradients of ``got``; returns the gradients holding NaN/Inf."""
        groups: dict[torch.device, tuple[list[WatchedParam], list[torch.Tensor], list[int]]] = {}
        index = self._index
        for wp in got:
            g = wp.param.grad
            if g is None:
                continue
            if type(g) is not torch.Tensor:
                g = _local(g)
            if g.is_sparse:
                g = sparse_values(g)
            if not g.numel():
                continue
            group = groups.get(g.device)
            if group is None:
                group = groups[g.device] = ([], [], [])
            group[0].append(wp)
            group[1].append(g)
            group[2].append(index[wp.module])
        sums = [0.0] * len(self.modules)
        seen = [False] * len(self.modules)
        bad: list[BadGrad] = []
        for wps, grads, idx in groups.values():
            norms = torch.stack(foreach_norm(grads, 2, dtype=torch.float32)).tolist()  # one sync
            for i, n in zip(idx, norms):
                sums[i] += n * n
                seen[i] = True
            if math.isfinite(sum(norms)):
                continue
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

    def __init__(self, optimizer, params: list[WatchedParam], flow: Flow, every: int):
        self._flow, self._every, self._params = flow, every, params
        self._calls = 0
        self._before: tuple[list[torch.Tensor], list[torch.Tensor], list[float]] | None = None
        self._handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def _pre(self, _opt, _args, _kwargs):
        self._calls += 1
        if self._calls % self._every:  # steps every, 2*every, ...
            self._before = None
            return
        with torch.no_grad():
            tensors = [_local(wp.param.detach()) for wp in self._params]
            wn = torch.stack(foreach_norm(tensors, 2, dtype=torch.float32)).double().square().tolist()
            self._before = (tensors, foreach_mul(tensors, 1.0), wn)

    def _post(self, _opt, _args, _kwargs):
        if self._before is None:
            return
        tensors, before, wn = self._before
        self._before = None
        with torch.no_grad():
            foreach_sub_(before, tensors)  # in place: -(update), same norm
            dn = torch.stack(foreach_norm(before, 2, dtype=torch.float32)).double().square().tolist()
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
