"""The per-parameter hooks of :class:`gradscope.watching.guard.Watch` (a mixin: it uses the guard's state).

See NOTE [end of backward] in :mod:`gradscope.watching.guard` for what the two hooks do.

NOTE [replaced parameters]
``m.weight = nn.Parameter(...)`` after ``watch()`` swaps the tensor in the module's ``_parameters`` dict;
the new one has none of our hooks. Before each forward of the watched model (and at each check) every
watched slot is compared by identity with its dict entry, and a replaced parameter is re-hooked and
watched under the same name from then on; a deleted one is dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
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
        arrived, accumulated = self._hooks(i)
        p = self._params[i].param
        return [p.register_hook(arrived), p.register_post_accumulate_grad_hook(accumulated)]

    def _install(self) -> list:
        return [self._hook_one(i) for i in range(len(self._params))]

    def _refresh(self) -> None:
        """NOTE [replaced parameters]."""
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
