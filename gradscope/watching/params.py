"""The per-parameter hooks of :class:`gradscope.watching.guard.Watch` (a mixin: it uses the guard's state).

See NOTE [end of backward] in :mod:`gradscope.watching.guard` for what the two hooks do.

NOTE [nested backward]
A reentrant ``checkpoint(use_reentrant=True)`` runs a second, nested backward from inside a node of the
outer one; its parameters' hooks fire in the nested graph task, and a callback queued there runs when the
nested backward ends, before the outer one has reached the parameters in front of the checkpoint. The
callback sees that it is nested (``torch._C._current_autograd_node()`` is the outer node, not None) and
moves itself to the outer backward: a one-shot post hook on that outer node queues the callback again,
this time in the outer graph task. Nested task ids are larger than the outer id, so their stamps count.

NOTE [last callback]
Other end-of-backward callbacks may still be queued behind ours: DDP's reducer queues its
``finalize_backward`` (which waits for the all-reduce and writes the averaged gradients into ``.grad``)
when its last bucket is ready, after our first hook. The engine runs callbacks queued by a callback too, so
ours queues itself once more and checks from there, after DDP's: every rank then tests the same averaged
gradients for NaN/Inf, and a NaN on one rank is reported by all of them instead of leaving the others
waiting in the next collective.

NOTE [replaced parameters]
``m.weight = nn.Parameter(...)`` after ``watch()`` swaps the tensor in the module's ``_parameters`` dict;
the new one has none of our hooks. Before each forward of the watched model (and at each check) every
watched slot is compared by identity with its dict entry, and a replaced parameter is re-hooked and
watched under the same name from then on; a deleted one is dropped.

NOTE [swapped for one call]
``torch.func.functional_call(model, tensors, x)`` (MAML's fast weights, ``torch.func.grad`` and ``vmap``
over a model) puts plain tensors into the modules' ``_parameters`` dicts for one call and puts the
parameters back after it; the forward hooks see the swapped dicts. A slot holding a tensor that is not an
``nn.Parameter`` is therefore not a replacement: the watched parameter stays watched and hooked (torch
itself only lets an ``nn.Parameter`` be assigned to a parameter attribute). Before, the watched parameter
was dropped (or the transient tensor hooked and kept alive) and the outer backward went unchecked.

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
from typing import Any

import torch
from torch.nn.parameter import is_lazy
from torch.utils.hooks import RemovableHandle, unserializable_hook

from gradscope._torch import current_autograd_node, current_graph_task_id, queue_engine_callback
from gradscope.watching.options import ignored
from gradscope.watching.step import WatchedParam

__all__ = ["ParamHooks"]

_NO_SLOT: dict = {}  # the slot of a parameter no longer watched


class ParamHooks:
    # The guard's state this mixin uses (set by Watch.__init__; declared here for the type checker only).
    _params: list[WatchedParam]
    _slots: list[tuple[dict[str, torch.nn.Parameter | None], str]]  # (module._parameters, attribute name)
    _param_ids: dict[int, str]
    _handles: list[list[RemovableHandle]]
    _stamp: list[int]
    _arrival: list[int]
    _pending: set[int]
    _lazy: set[int]  # indices of parameters not materialized yet (NOTE [lazy parameters])
    _last: Callable[[], None]
    _removed: bool
    _node_hooks: list
    _safety: Any
    _root: Any  # the watched module; None once removed
    _ignore: tuple[str, ...]
    _changes: int  # bumped whenever the watched tensors change (optimizers' cached indices go stale)
    _index: dict[str, int]  # name -> index in _params (the live one, when a name was replaced)
    _flow: Any

    def _on_end(self) -> None:
        self._safety.run("gradient", self._end)

    def _on_last(self) -> None:
        self._safety.run("gradient", self._last)

    def _end(self) -> None:
        tid = current_graph_task_id()
        self._pending.discard(tid)
        if self._removed:
            return
        node = current_autograd_node()
        if node is not None:  # NOTE [nested backward]: hand over to the outer task
            handle: Any = None  # set right below, before the hook can run

            def requeue(_grad_inputs, _grad_outputs):
                handle.remove()
                if handle in self._node_hooks:
                    self._node_hooks.remove(handle)
                outer = current_graph_task_id()
                if not self._removed and outer not in self._pending:
                    self._pending.add(outer)
                    queue_engine_callback(self._on_end)

            handle = node.register_hook(requeue)
            self._node_hooks.append(handle)
            return
        queue_engine_callback(self._on_last)  # NOTE [last callback]

    @staticmethod
    def _owner(root, name: str) -> tuple[str, str]:
        module = name.rpartition(".")[0]
        return module, type(root.get_submodule(module)).__name__

    def _tensors(self) -> list:
        return [wp.param for wp in self._params]

    def _hooks(self, i: int):
        stamp, arrival, pending, on_end = self._stamp, self._arrival, self._pending, self._on_end

        @unserializable_hook  # NOTE [copied modules] in gradscope.watching.safety
        def arrived(grad) -> None:  # NOTE [end of backward]
            if grad is not None:
                arrival[i] = current_graph_task_id()

        def accumulated(_param) -> None:
            tid = current_graph_task_id()
            if arrival[i] == tid:  # a defined gradient, accumulated into .grad by this backward
                stamp[i] = tid
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
        self._lazy, self._changes = set(), 0
        self._arrival = [-1] * len(self._params)  # graph task id of each one's last defined incoming gradient
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

    def _drop(self, i: int) -> None:
        """Stop watching parameter ``i`` (its index stays, with an empty tensor that needs no gradient)."""
        self._changes += 1
        for h in self._handles[i]:
            h.remove()
        self._handles[i] = []
        self._param_ids.pop(id(self._params[i].param), None)
        self._params[i] = self._params[i]._replace(param=torch.empty(0, requires_grad=False))
        self._stamp[i] = -1
        self._lazy.discard(i)
        if self._index.get(self._params[i].name) == i:
            del self._index[self._params[i].name]

    def _rescan(self) -> list[str]:
        """Read the model's parameters again (NOTE [judged at the step] in :mod:`gradscope.watching.stepping`):
        stop watching those no longer in it, watch the new ones (a new one whose ``.grad`` is set counts as
        received in the latest backward); returns the names of the new ones."""
        now = {id(p): (n, p) for n, p in self._root.named_parameters() if not ignored(n, self._ignore)}
        live = {id(wp.param): i for i, wp in enumerate(self._params) if id(wp.param) in self._param_ids}
        for key, i in live.items():
            if key not in now:
                self._drop(i)
                self._slots[i] = (_NO_SLOT, "")
        added = []
        latest = max(self._stamp, default=-1)
        for key, (name, p) in now.items():
            if key in live or not p.requires_grad or not p.is_leaf:
                continue
            i = len(self._params)
            self._params.append(WatchedParam(name, p, *self._owner(self._root, name)))
            self._slots.append((self._root.get_submodule(self._params[i].module)._parameters, name.rpartition(".")[2]))
            self._param_ids[key] = name
            self._changes += 1
            self._index[name] = i
            self._stamp.append(latest if p.grad is not None else -1)
            self._arrival.append(-1)
            self._handles.append(self._hook_one(i))
            self._flow.add_module(self._params[i].module)
            added.append(name)
        return added

    def _refresh(self, tid: int = -1) -> None:
        """NOTE [replaced parameters], NOTE [lazy parameters]."""
        if self._lazy:
            self._materialized(tid)
        params, slots = self._params, self._slots
        for i in [i for i, (d, key) in enumerate(slots) if d.get(key) is not params[i].param and d is not _NO_SLOT]:
            new = slots[i][0].get(slots[i][1])
            if isinstance(new, torch.Tensor) and not isinstance(new, torch.nn.Parameter):
                continue  # NOTE [swapped for one call]
            self._drop(i)
            if isinstance(new, torch.Tensor) and new.is_leaf:
                params[i] = params[i]._replace(param=new)
                self._param_ids[id(new)] = params[i].name
                self._index[params[i].name] = i
                self._handles[i] = self._hook_one(i)
            else:  # deleted, or no longer a leaf: stop watching it
                slots[i] = (_NO_SLOT, "")
