"""Where carried state lives: tensors inside a forward's inputs at any depth, and in module attributes.

NOTE [carried state]
A graph is carried across steps by whatever holds a tensor with a ``grad_fn`` from one step into the
next. Inputs are read at any depth (tuples of tuples such as GPT-2's ``past_key_values``, dicts, a
detector's list of dicts) and into objects that hold tensors (a dataclass output, an HF ``Cache`` whose
layers hold ``keys`` / ``values``), through their ``__dict__``. Module attributes and buffers
(``self.h`` of a stateful LSTM, a spiking neuron's membrane potential) are read on every module of the
model, into lists, tuples and dicts. Every read is bounded: at most 256 objects per value and 64 items per
container, so a step pays the same whatever the user passes.

An input is judged at the forward (it is about to be used). An attribute may be kept for logging and
never used again, so it is judged only if a backward reaches it: a one-shot pre-hook goes on the
``grad_fn`` of each attribute tensor built before the boundary, and the finding is made there. The
boundary is the optimizer step when one is known (the smallest of the known optimizers' last steps, so
a GAN's ``self.fake``, built after the generator's last step, is not old yet), otherwise the last
watched backward, checked at the next forward of the model.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

import torch

from gradscope._format import human_bytes
from gradscope._torch import current_autograd_node, sequence_nr
from gradscope.errors import GradientError
from gradscope.findings import CARRIED_GRAPH, ERROR, Finding
from gradscope.watching.holders import frame_location, user_frame
from gradscope.watching.walks import graph_stats
from gradscope.watching.writers import written_at

__all__ = ["tensors_in", "state_tensors", "CarriedChecks"]

_OBJECTS = 256
_ITEMS = 64
_LEAVES = (str, bytes, int, float, bool, complex, type(None), type, torch.nn.Module, torch.dtype, torch.device)


def tensors_in(value, label: str, objects: bool = True, cap: int = _OBJECTS) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for each tensor inside ``value`` (containers at any depth; with ``objects``, the
    attributes of objects too), at most ``cap`` objects visited (NOTE [carried state])."""
    out: list[tuple[str, torch.Tensor]] = []
    stack: list[tuple[str, object]] = [(label, value)]
    seen: set[int] = set()
    visited = 0
    while stack and visited < cap:
        where, v = stack.pop()
        visited += 1
        if isinstance(v, torch.Tensor):
            out.append((where, v))
            continue
        if isinstance(v, _LEAVES) or id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, dict):
            items = [(f"{where}[{k!r}]", x) for k, x in islice(v.items(), _ITEMS)]
        elif isinstance(v, (list, tuple)):
            items = [(f"{where}[{i}]", x) for i, x in enumerate(islice(v, _ITEMS))]
        elif objects and isinstance(getattr(v, "__dict__", None), dict):
            items = [(f"{where}.{k}", x) for k, x in islice(vars(v).items(), _ITEMS) if not k.startswith("__")]
        else:
            continue
        stack.extend(reversed(items))
    return out


def state_tensors(modules: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.Tensor]]:
    """``(description, tensor)`` for each tensor with a ``grad_fn`` held in a module attribute or buffer."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, m in modules:  # this runs on every step: the common attributes cost one set lookup each
        d = m.__dict__
        buffers = d.get("_buffers")
        if buffers:
            out.extend((_said("buffer", k, name, m), b) for k, b in buffers.items() if b is not None and b.grad_fn)
        for key, v in [(k, d[k]) for k in d if k not in _MODULE_KEYS and type(d[k]) not in _PLAIN]:
            if key[0] == "_":
                continue
            if isinstance(v, torch.Tensor):
                if v.grad_fn is not None:
                    out.append((_said("attribute", key, name, m), v))
            elif isinstance(v, (list, tuple)) and _PLAIN.issuperset(map(type, v[:_ITEMS])):
                continue  # a shape, a tuple of flags
            elif isinstance(v, (list, tuple, dict)):
                out.extend(
                    (_said("attribute", path, name, m), t)
                    for path, t in tensors_in(v, key, objects=False)
                    if t.grad_fn is not None
                )
    return out


_PLAIN = frozenset({bool, int, float, str, type(None)})
_MODULE_KEYS = frozenset(torch.nn.Module().__dict__)  # what every module holds: hooks, _parameters, ...


def _said(what: str, key: str, name: str, m: torch.nn.Module) -> str:
    owner = f"of module {name!r} ({type(m).__name__})" if name else f"of the model ({type(m).__name__})"
    line = written_at(type(m), key.partition("[")[0])  # NOTE [the line that wrote it]
    how = "written in place" if what == "buffer" else "written"
    return f"the {what} {key!r} {owner}{f', {how} at {line},' if line else ''}"


_FREED = (
    "gradscope.watch: this backward reached a graph from an earlier step that was already freed: torch would "
    'now raise "Trying to backward through the graph a second time (or directly access saved tensors after '
    'they have already been freed)".\n- '
)


def _reach_text(reached, nodes) -> str:
    return (
        f"{len(reached)} parameter{'s' if len(reached) != 1 else ''} of the model "
        f"({', '.join(sorted(reached)[:4])}{', ...' if len(reached) > 4 else ''}) through {nodes} "
        f"node{'s' if nodes != 1 else ''} from before this step"
    )


def _carried_finding(what, fix, held, freed, reached, location) -> Finding:
    if freed:
        msg = (
            f"{what}, whose saved tensors the previous backward already freed, so this step's "
            f'backward will fail with "Trying to backward through the graph a second time".{fix}'
        )
    else:
        msg = (
            f"{what} and keeps {human_bytes(held)} of saved tensors alive. That graph was not freed (kept "
            f"with retain_graph=True, or built by a forward no backward has run), so this step's backward "
            f"runs through the earlier step again and memory grows every step.{fix}"
        )
    return Finding(CARRIED_GRAPH, ERROR, msg, params=tuple(sorted(reached)), location=location)


class CarriedChecks:
    """``carried-graph`` for :class:`~gradscope.watching.graphs.GraphWatch` (a mixin over its state)."""

    _param_ids: dict[int, str]
    _mark: int
    _root: Any
    _root_name: str
    _modules: list
    _scans: int
    _state_hooked: set[int]
    _active: bool
    _enabled: bool
    _carried_seen: bool
    _safety: Any
    _report: Any
    _pstores: Any
    _origin: Any

    def _scan(self, value, mark, name) -> None:
        """NOTE [carried state]: the tensors inside an input, at any depth."""
        pairs = [(name, value)] if isinstance(value, torch.Tensor) else tensors_in(value, name)
        for path, t in pairs:
            fn = t.grad_fn
            if fn is not None and sequence_nr(fn) < mark:
                self._carried(fn, name, path)
                return

    # -- carried state in module attributes (NOTE [carried state]) -----------------------------------
    def scan_state(self, boundary: int) -> None:
        """Put a one-shot pre-hook on the ``grad_fn`` of each attribute tensor built before ``boundary``."""
        if not self._enabled or not self._active:
            return
        self._scans += 1
        if self._scans % 100 == 0:
            self._modules = list(self._root.named_modules())
        hooked = self._state_hooked
        if len(hooked) > 4096:
            hooked.clear()
        for label, t in state_tensors(self._modules):
            fn = t.grad_fn
            if fn is not None and sequence_nr(fn) < boundary and id(fn) not in hooked:
                hooked.add(id(fn))
                fn.register_prehook(self._state_hook(label))

    def _state_hook(self, label: str):
        done: list = []

        def reached(_grad_outputs):  # holds no node (NOTE [carried state])
            if not done and self._active:
                done.append(True)
                self._safety.run("graphs", self._state_reached, label)

        return reached

    def _state_reached(self, label: str) -> None:
        node = current_autograd_node()
        if node is None:
            return
        nodes, held, freed, reached = graph_stats([node], self._param_ids, self._pstores(), below=self._mark)
        if not reached:
            return
        what = (
            f"{label[0].upper()}{label[1:]} holds a tensor whose autograd graph was built in an earlier step"
            f"{self._origin(sequence_nr(node))}, and this backward reached it: it leads to "
            + _reach_text(reached, nodes)
        )
        fix = (
            " Fix: store the state detached at the step boundary (`self.h = h.detach()`), as truncated "
            "backpropagation through time does."
        )
        finding = _carried_finding(what, fix, held, freed, reached, None)
        self._carried_seen = True
        if freed:
            raise GradientError(_FREED + finding.message, [finding])
        self._report([finding])

    def _carried(self, fn, name, path):
        nodes, held, freed, reached = graph_stats([fn], self._param_ids, self._pstores(), below=self._mark)
        if not reached:
            return  # another model's output (a GAN's fake): not ours
        frame = user_frame()
        location = frame_location(frame)
        del frame
        inside = f" (at {path})" if path != name else ""
        what = (
            f"The input {name!r}{inside} of {self._root_name}.forward"
            + (f" at {location}" if location else "")
            + f" carries an autograd graph built in an earlier step{self._origin(sequence_nr(fn))}: it reaches "
            + _reach_text(reached, nodes)
        )
        fix = (
            f" Fix: cut the graph at the step boundary, `{name} = {name}.detach()` before passing it in "
            f"(truncated backpropagation through time)."
            if path == name
            else f" Fix: cut the graph at the step boundary: detach the tensors you pass as {name!r} (all of "
            f"them, e.g. every key and value of a cache) before passing them in."
        )
        finding = _carried_finding(what, fix, held, freed, reached, location)
        self._carried_seen = True
        if freed:
            self._explain_later(fn, finding)
        self._report([finding])

    def _explain_later(self, fn, finding):
        """If the backward reaches the freed graph anyway, raise our explanation instead of torch's."""

        def explain(_grad_outputs):
            if self._active:
                raise GradientError(_FREED + finding.message, [finding])

        fn.register_prehook(explain)
