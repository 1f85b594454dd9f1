"""Which watched modules ran with grad disabled, and where: the cause of a ``none-grad`` said in the user's
words ("module 'embed' ran under torch.no_grad() at train.py:12") instead of the list of likely causes.

NOTE [modules run under no_grad]
A forward pre-hook on each module that owns a watched parameter reads ``torch.is_grad_enabled()`` (a C
call) and nothing else while grad is on. When grad is off it records the user's line once, until the module
runs with grad on again, so an evaluation loop under ``torch.no_grad()`` costs one frame walk per module per
switch and a training forward that follows clears it. Only the latest call of a module counts: a module run
once with grad and once without in one forward is judged by its last call. The hook never raises
(:class:`~gradscope.watching.safety.Safety`) and holds no tensor, only names and ``file:line`` strings.
"""

from __future__ import annotations

import torch

from gradscope._frames import frame_location, user_caller
from gradscope.watching.safety import InertCopy, Safety

__all__ = ["NoGradCalls"]


class NoGradCalls:
    """Module name -> ``file:line`` of its latest forward run with grad disabled (NOTE above)."""

    def __init__(self, root: torch.nn.Module, module_names, safety: Safety) -> None:
        self.where: dict[str, str] = {}
        self._safety = safety
        self._handles = []
        for name in sorted(set(module_names)):
            hook = InertCopy(self._pre, name)  # NOTE [copied modules]
            self._handles.append(root.get_submodule(name).register_forward_pre_hook(hook))

    def _pre(self, name: str, module, args) -> None:
        if torch.is_grad_enabled():
            if name in self.where:
                del self.where[name]
        elif name not in self.where and not torch.compiler.is_compiling():  # NOTE [torch.compile] (graphs.py)
            self._safety.run("no-grad modules", self._record, name)

    def _record(self, name: str) -> None:
        self.where[name] = frame_location(user_caller(3)) or "a line outside the user's code"

    def causes(self) -> dict[str, str]:
        """Module name -> the sentence that replaces the list of likely causes for its parameters."""
        return {
            name: (
                f"Module {name or 'the root'!r} ran with grad disabled (under torch.no_grad() or "
                f"torch.set_grad_enabled(False)) at {line}, so none of its parameters took part in the graph. "
                f"Fix: run it with grad enabled (remove the no_grad around it), or freeze its parameters with "
                f"requires_grad_(False) if that is what you meant."
            )
            for name, line in self.where.items()
        }

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.where.clear()
