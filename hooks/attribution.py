"""Which module issued a collective, and in which phase: forward, backward, optimizer step, other.

While enabled, every ring record carries ``(module, phase)``; how, and what it costs: docs/running.md
("Module attribution").

Example::

    from commlens.hooks import attribution
    attribution.enable()               # COMMLENS_MODULE_ATTRIBUTION=true under commlens.agent
    model(x)                           # an all_reduce inside model.encoder.block3 records that name
    attribution.disable()
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim

from . import process_ring
from ._state import state

"""By the phase byte of a record; 0 (``""``): attribution was off."""
OTHER, FORWARD, BACKWARD, OPTIMIZER = range(1, 5)
_in_backward = torch._C._current_graph_task_id


class ModuleAttribution:
    def __init__(self, ring: Any):
        self.ring = ring
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._local = threading.local()
        self._handles: list[Any] = []

    def where(self) -> int:
        """``(module string id << 8) | phase`` for a collective issued now on this thread."""
        local = self._local
        stack = getattr(local, "stack", None)
        module = stack[-1] if stack else 0
        if _in_backward() != -1:
            return module << 8 | BACKWARD
        if getattr(local, "optimizer", False):
            return module << 8 | OPTIMIZER
        return module << 8 | (FORWARD if stack else OTHER)

    def enable(self) -> ModuleAttribution:
        if not self._handles:
            self._handles = [nn_module.register_module_forward_pre_hook(self._enter),
                             nn_module.register_module_forward_hook(self._leave, always_call=True),
                             optim.register_optimizer_step_pre_hook(self._step_begins),
                             optim.register_optimizer_step_post_hook(self._step_ends)]
        return self

    def disable(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _enter(self, module: torch.nn.Module, _args: Any) -> None:
        sid = self._names.get(module)
        if sid is None:
            self._name_tree(module)
            sid = self._names.get(module, 0)
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(sid)

    def _leave(self, module: torch.nn.Module, _args: Any, _output: Any) -> None:
        stack = getattr(self._local, "stack", None)
        if stack:
            stack.pop()

    def _name_tree(self, root: torch.nn.Module) -> None:
        prefix = type(root).__name__
        for name, module in root.named_modules():
            if module not in self._names:
                self._names[module] = self.ring.intern(name or prefix)

    def _step_begins(self, *_: Any) -> None:
        self._local.optimizer = True

    def _step_ends(self, *_: Any) -> None:
        self._local.optimizer = False


_active: ModuleAttribution | None = None


def enable() -> ModuleAttribution:
    """Attribute every collective recorded from now on. Idempotent."""
    global _active
    if _active is None:
        _active = ModuleAttribution(process_ring.ring()).enable()
        state.where = _active.where
    return _active


def disable() -> None:
    global _active
    if _active is not None:
        state.where = None
        _active.disable()
        _active = None
