"""The per-parameter hooks of :class:`gradscope.watching.guard.Watch` (a mixin: it uses the guard's state).

See NOTE [end of backward] in :mod:`gradscope.watching.guard` for what the two hooks do.

NOTE [replaced parameters]
``m.weight = nn.Parameter(...)`` after ``watch()`` swaps the tensor in the module's ``_parameters`` dict;
the new one has none of our hooks. Before each forward of the watched model (and at each check) every
watched slot is compared by identity with its dict entry, and a replaced parameter is re-hooked and
watched under the same name from then on; a deleted one is dropped.

NOTE [lazy parameters]
A lazy module's parameters (``nn.LazyLinear``) are ``UninitializedParameter``s until its first forward,
and torch refuses a hook on them (``ValueError``). Such a parameter is watched from the start but hooked
only once materialized: at each forward and at each check. Materializing turns the same object into a
plain ``Parameter`` (in place, so the slot keeps it); the check of the backward that follows counts it as
received when its ``.grad`` is set, since a parameter that did not exist before this step cannot hold an
older one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.parameter import is_lazy
from torch.utils.hooks import RemovableHandle

from gradscope._torch import current_graph_task_id, queue_engine_callback
from gradscope.watching.step import WatchedParam

__all__ = ["ParamHooks"]


class ParamHooks:
    # The guard's state this mixin uses (set by Watch.__init__; declared here for the type checker only).
    _params: list[WatchedParam]
    _slots: list[tuple[dict[str, torch.nn.Parameter | None], str]]  # (module._parameters, attribute name)
    _param_ids: dict[int, str]
    _handles: list[list[RemovableHandle]]
    _stamp: list[int]
    _pending: set[int]
    _lazy: set[int]  # indices of parameters not materialized yet (NOTE [lazy parameters])
    _on_end: Callable[[], None]

    @staticmethod
    def _owner(root, name: str) -> tuple[str, str]:
        module = name.rpartition(".")[0]
        return module, type(root.get_submodule(module)).__name__

    def _tensors(self) -> list:
        return [wp.param for wp in self._params]

    def _hooks(self, i: int):
        stamp, pending, on_end = self._stamp, self._pending, self._on_end

        def arrived(grad) -> None:  # NOTE [end of backward]
            if grad is not None:
                stamp[i] = current_graph_task_id()

        def accumulated(_param) -> None:
            tid = current_graph_task_id()
            if tid not in pending:
                pending.add(tid)
                queue_engine_callback(on_end)

        return arrived, accumulated

    def _hook_one(self, i: int) -> list:
        p = self._params[i].param
        if is_lazy(p):  # NOTE [lazy parameters]
            self._lazy.add(i)
            return []
        arrived, accumulated = self._hooks(i)
        return [p.register_hook(arrived), p.register_post_accumulate_grad_hook(accumulated)]

    def _install(self) -> list:
        self._lazy = set()
        return [self._hook_one(i) for i in range(len(self._params))]

    def _materialized(self, tid: int = -1) -> None:
        """Hook the lazy parameters materialized since (NOTE [lazy parameters]); at a check (``tid`` of its
        backward), one whose ``.grad`` is set counts as received in it."""
        for i in sorted(self._lazy):
            p = self._params[i].param
            if not is_lazy(p):
                self._lazy.discard(i)
                self._handles[i] = self._hook_one(i)
                if tid >= 0 and p.grad is not None:
                    self._stamp[i] = tid

    def _refresh(self, tid: int = -1) -> None:
        """NOTE [replaced parameters], NOTE [lazy parameters]."""
        if self._lazy:
            self._materialized(tid)
        params, slots = self._params, self._slots
        for i in [i for i, (d, key) in enumerate(slots) if d.get(key) is not params[i].param]:
            new = slots[i][0].get(slots[i][1])
            for h in self._handles[i]:
                h.remove()
            self._param_ids.pop(id(params[i].param), None)
            if isinstance(new, torch.Tensor) and new.is_leaf:
                params[i] = params[i]._replace(param=new)
                self._param_ids[id(new)] = params[i].name
                self._handles[i] = self._hook_one(i)
            else:  # deleted, or no longer a leaf: stop watching it
                self._handles[i] = []
                params[i] = params[i]._replace(param=torch.empty(0, requires_grad=False))
            self._stamp[i] = -1
