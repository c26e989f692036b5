"""``watch_loss_scaling()``: what a dynamic loss scaler did with each step, into the ring.

A step whose scaled gradients overflow holds Inf (or NaN) by design; LOSS_SCALE records let the
sidecar tell that overflow from values entering the job (docs/verdicts.md). Reading whether the step
was skipped copies the found-Inf flags to the host once per step, after ``GradScaler.step`` waited.

Example::

    unwatch = watch_loss_scaling()
    scaler = torch.amp.GradScaler("cuda")    # LOSS_SCALE "made": its first step begins
    scaler.scale(loss).backward()   # LOSS_SCALE "scaled"
    scaler.step(optimizer)
    scaler.update()                 # LOSS_SCALE "applied", or "skipped" after an overflow
    unwatch()
"""

from __future__ import annotations

from typing import Any, Callable

from . import process_ring, record
from .patch import Patches


def _made(original: Callable) -> Callable:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self._enabled:
            _write("made")
    return init


def _scaled(original: Callable) -> Callable:
    def scale(self: Any, outputs: Any) -> Any:
        scaled = original(self, outputs)
        if self._enabled:
            _write("scaled")
        return scaled
    return scale


def _updated(original: Callable) -> Callable:
    def update(self: Any, new_scale: Any = None) -> None:
        event = _outcome(self) if self._enabled and new_scale is None else None
        original(self, new_scale)
        if event is not None:
            _write(event)
    return update


def _outcome(scaler: Any) -> str | None:
    """"skipped" when any optimizer's gradients held Inf or NaN this step (what ``update`` lowers the
    scale for), else "applied"; None when commlens cannot tell (counted, the step goes on)."""
    try:
        found = [flag for state in scaler._per_optimizer_states.values()
                 for flag in state["found_inf_per_device"].values()]
        return "skipped" if any(float(flag) for flag in found) else "applied"
    except Exception as error:  # a torch whose scaler keeps its state elsewhere
        process_ring.internal_error("loss scaling", error)
        return None


def _write(event: str) -> None:
    try:
        record.loss_scale(record.writer(), event)
    except Exception as error:
        process_ring.internal_error("loss scaling", error)


def watch_loss_scaling() -> Callable[[], None]:
    """Record every ``torch.amp.GradScaler``'s steps (its CUDA and CPU subclasses' too) until the
    returned function is called."""
    from torch.amp import GradScaler

    patches = Patches()
    patches.add(GradScaler.__init__, _made, "torch.amp.GradScaler.__init__")
    patches.add(GradScaler.scale, _scaled, "torch.amp.GradScaler.scale")
    patches.add(GradScaler.update, _updated, "torch.amp.GradScaler.update")
    return patches.undo
