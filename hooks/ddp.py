"""DDP gradient buckets as collectives: a communication hook that wraps any other.

``wrap(hook)`` returns a DDP communication hook that records each gradient bucket as one
``all_reduce``: the same pre- and post-hooks fire for it (so ``NanCheckHook`` checks the bucket before
it is reduced), it takes c10d's sequence number of the collective the hook issues, and it completes
when the hook's future does. The collectives the wrapped hook issues itself are not recorded a
second time; their payload is the bucket's size after compression (``DdpBucket.wire_bytes``).

Example::

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model.register_comm_hook(None, commlens.hooks.ddp.wrap(default_hooks.fp16_compress_hook))

With ``instrument()`` on, a hook a user registers is wrapped the same way, and a DDP model that
registers none gets PyTorch's ``allreduce_hook``, wrapped, before its first forward.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from . import groups, recorder
from .ops import OpName

@dataclasses.dataclass
class DdpBucket:
    """What commlens knows of one gradient bucket; ``pre.bucket`` in the hook arguments."""

    index: int
    parameters: int
    is_last: bool
    nbytes: int
    wire_bytes: int = 0
    """Bytes the wrapped hook's own collectives carried (after compression); known once it returned."""


_scope = threading.local()
"""``bucket`` is set while a wrapped hook runs: collectives it issues add to it, unrecorded."""
active = 0
"""Wrapped hooks running now, in any thread: the torch.distributed wrappers look further only then."""
_active_lock = threading.Lock()


def nested_collective(tensors: tuple, output_tensors: tuple) -> bool:
    """True (and its bytes counted) for a collective issued by a wrapped hook on this thread."""
    bucket = getattr(_scope, "bucket", None)
    if bucket is None:
        return False
    bucket.wire_bytes += recorder.signature(tensors, output_tensors)[1]
    return True


def wrap(hook: Callable | None = None) -> Callable:
    """``hook`` (default: PyTorch's ``allreduce_hook``) recording every bucket it reduces."""
    inner = default_hooks.allreduce_hook if hook is None else hook
    if getattr(inner, "_commlens_wrapped", False):
        return inner
    if not callable(inner):
        raise TypeError(f"wrap() takes a DDP communication hook hook(state, bucket) -> Future; got {inner!r}")

    @functools.wraps(inner)
    def recorded(state: Any, bucket: Any):
        buffer = bucket.buffer()
        info = DdpBucket(bucket.index(), len(bucket.parameters()), bucket.is_last(),
                         buffer.numel() * buffer.element_size())
        try:
            group = groups.group_of(_process_group(state))
        except Exception as error:  # commlens could not record it: the bucket goes on unrecorded
            recorder.internal_error("ddp bucket", error)
            return inner(state, bucket)
        tensors = (buffer,)
        flight = recorder.start(OpName.all_reduce, group, tensors, tensors, True, None, None, bucket=info)
        if flight is None:
            return inner(state, bucket)
        global active
        with _active_lock:
            active += 1
        _scope.bucket = info
        try:
            future = inner(state, bucket)
        except BaseException as error:
            flight.failed(error)
            raise
        finally:
            _scope.bucket = None
            with _active_lock:
                active -= 1
        future.add_done_callback(flight._future_done)
        return future

    recorded._commlens_wrapped = True
    return recorded


def _process_group(state: Any) -> Any:
    if isinstance(state, dist.ProcessGroup):
        return state
    return getattr(state, "process_group", None)


_patched: dict[str, Any] = {}


def instrument_ddp() -> None:
    """Wrap every hook registered from now on; give hookless models a wrapped default. Idempotent."""
    if _patched:
        return
    original_register, original_init = DistributedDataParallel.register_comm_hook, DistributedDataParallel.__init__

    def register_comm_hook(self, state, hook):
        self._commlens_hooked = True
        return original_register(self, state, wrap(hook))

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self._commlens_hooked = False
        self._commlens_default = self.register_forward_pre_hook(_default_before_first_forward)

    DistributedDataParallel.register_comm_hook = functools.wraps(original_register)(register_comm_hook)
    DistributedDataParallel.__init__ = functools.wraps(original_init)(__init__)
    _patched.update(register_comm_hook=original_register, __init__=original_init)


def _default_before_first_forward(model: DistributedDataParallel, _inputs: Any) -> None:
    model._commlens_default.remove()
    if not getattr(model, "_commlens_hooked", True):
        model.register_comm_hook(model.process_group, None)


def uninstrument_ddp() -> None:
    for name, original in _patched.items():
        setattr(DistributedDataParallel, name, original)
    _patched.clear()
