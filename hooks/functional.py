"""Instrumentation of PyTorch's functional collectives, the ones DTensor and tensor parallelism issue.

``instrument_functional()`` wraps the Python entry points of ``torch.distributed._functional_collectives``
and ``wait_tensor`` in place (``patch.Patch``); END comes at the output's first wait. What is and is
not covered: docs/hooks.md.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.distributed.distributed_c10d as c10d
import torch.distributed._functional_collectives as funcol

from commlens.ring.layout import OK
from commlens.ring.ops import OpName

from . import groups, issuing, process_ring
from .patch import Patches
from .recorder import InFlight


def _resized(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """A meta tensor shaped like ``t`` but ``size`` long in ``dim``: the shape of an output not yet made."""
    shape = list(t.shape)
    shape[dim] = size
    return torch.empty(shape, dtype=t.dtype, device="meta")


# Each mirrors the funcol function of the same name and returns
# (group, tag, input tensors, output tensors or their meta stand-ins, root as a group rank).
def _broadcast(self, src, group, tag=""):
    tensors = (self,)  # one tuple for inputs and outputs: the signature's fast path
    return group, tag, tensors, tensors, src


def _all_reduce(self, reduceOp, group, tag=""):
    tensors = (self,)
    return group, tag, tensors, tensors, None


def _all_gather_single(self, gather_dim, group, tag=""):
    return group, tag, (self,), (_resized(self, gather_dim, self.shape[gather_dim] * _size(group, tag)),), None


def _reduce_scatter_single(self, reduceOp, scatter_dim, group, tag=""):
    return group, tag, (self,), (_resized(self, scatter_dim, self.shape[scatter_dim] // _size(group, tag)),), None


def _all_to_all_single(self, output_split_sizes, input_split_sizes, group, tag=""):
    if output_split_sizes is None:
        tensors = (self,)
        return group, tag, tensors, tensors, None
    return group, tag, (self,), (_resized(self, 0, sum(output_split_sizes)),), None


def _all_reduce_coalesced(self, reduceOp, group, tag=""):
    tensors = tuple(self)
    return group, tag, tensors, tensors, None


def _all_gather_single_coalesced(self, group, tag=""):
    size = _size(group, tag)
    return group, tag, tuple(self), tuple(_resized(t, 0, t.shape[0] * size) for t in self), None


def _reduce_scatter_single_coalesced(inputs, reduceOp, scatter_dim, group, tag=""):
    size = _size(group, tag)
    return group, tag, tuple(inputs), tuple(_resized(t, scatter_dim, t.shape[scatter_dim] // size) for t in inputs), None


_DESCRIBE: dict[str, tuple[OpName, Callable[..., tuple]]] = {
    "broadcast": (OpName.broadcast, _broadcast),
    "all_reduce": (OpName.all_reduce, _all_reduce),
    "all_gather_single": (OpName.all_gather_into_tensor, _all_gather_single),
    "reduce_scatter_single": (OpName.reduce_scatter_tensor, _reduce_scatter_single),
    "all_to_all_single": (OpName.all_to_all_single, _all_to_all_single),
    "all_reduce_coalesced": (OpName.all_reduce, _all_reduce_coalesced),
    "all_gather_single_coalesced": (OpName.all_gather_into_tensor, _all_gather_single_coalesced),
    "reduce_scatter_single_coalesced": (OpName.reduce_scatter_tensor, _reduce_scatter_single_coalesced),
}
"""The functions that issue a C++ op; the others (``all_gather_tensor``, the ``*_autograd`` and
``*_inplace`` variants) call these, so each collective is recorded once."""


def _group_name(group: Any, tag: str) -> Any:
    if isinstance(group, list):  # ranks + tag: resolved without repeating funcol's deprecation warning
        return c10d._resolve_group_name_by_ranks_and_tag(group, tag)
    return funcol._resolve_group(group, tag)


def _size(group: Any, tag: str) -> int:
    return len(_group(group, tag).ranks)


def _group(group: Any, tag: str) -> Any:
    key = group if isinstance(group, (str, c10d.ProcessGroup)) else _group_name(group, tag)
    return groups.known.get(key) or groups.group_of(key)


PENDING_MAX = 4096
_pending: dict[int, tuple[InFlight, tuple[int, ...]]] = {}
"""Storage address of an output not yet waited for -> (its collective, the keys of all its outputs).
The collective holds its outputs until the wait, as PyTorch's own registry of unwaited work does; past
``PENDING_MAX`` outputs the oldest collective is let go, completed and counted (``work_unjudged``)."""
_pending_lock = threading.Lock()


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _instrumented(op: OpName, original: Callable, describe: Callable) -> Callable:
    def functional_collective(*args, **kwargs):
        if funcol._are_we_tracing():
            return original(*args, **kwargs)
        try:
            group, tag, tensors, outputs, root = describe(*args, **kwargs)
            info = _group(group, tag)
        except Exception:  # bad arguments or no such group: torch says so itself
            return original(*args, **kwargs)
        if info is groups.NOT_MEMBER:
            return original(*args, **kwargs)
        return issuing.record(op, info, tensors, outputs, True, root, None, original, args, kwargs, after=_track)

    functional_collective.__wrapped__ = original
    return functional_collective


def _track(flight: InFlight, result: Any) -> None:
    """Complete ``flight`` now if its outputs are ready; else when the first of them is waited for."""
    results = result if isinstance(result, list) else [result]
    flight.output_tensors = outputs = tuple(getattr(r, "elem", r) for r in results)
    if not all(isinstance(r, funcol.AsyncCollectiveTensor) and not r.completed for r in results):
        flight.complete(OK, None, in_caller=True)
        return
    entry = (flight, tuple(_key(t) for t in outputs))
    dropped = []
    with _pending_lock:
        for key in entry[1]:
            _pending[key] = entry
        while len(_pending) > PENDING_MAX:  # never waited for: memory stays bounded however long the job
            oldest = _pending[next(iter(_pending))]
            for key in oldest[1]:
                _pending.pop(key, None)
            dropped.append(oldest[0])
    for flight in dropped:
        process_ring.count_error("work_unjudged")
        flight.complete(OK, None)


def _finish(key: int, error: BaseException | None) -> None:
    """Complete the collective whose output under ``key`` has just been waited for."""
    with _pending_lock:
        found = _pending.get(key)
        if found is None:
            return
        for other in found[1]:
            _pending.pop(other, None)
    if error is not None:
        found[0].failed(error)
    else:
        found[0].complete(OK, None, in_caller=True)


def _wait_tensor(original: Callable) -> Callable:
    def wait_tensor(tensor):
        if not _pending:
            return original(tensor)
        try:
            key = _key(tensor)
        except Exception:
            return original(tensor)
        try:
            out = original(tensor)
        except BaseException as error:
            _finish(key, error)
            raise
        issuing.settle(_finish, key, None)
        return out

    wait_tensor.__wrapped__ = original
    return wait_tensor


def instrument_functional(patches: Patches) -> None:
    """Add the patches that record every functional collective; called by ``instrument()``."""
    for name, (op, describe) in _DESCRIBE.items():
        if not hasattr(funcol, name):  # before PyTorch 2.13 the entry points had other names: not covered
            continue
        patches.add(getattr(funcol, name), lambda original, op=op, describe=describe: _instrumented(op, original, describe),
                    f"torch.distributed._functional_collectives.{name}")
    patches.add(funcol.wait_tensor, _wait_tensor, "torch.distributed._functional_collectives.wait_tensor")


def uninstrument_functional() -> None:
    """Forget the functional collectives waiting for completion; ``instrument()``'s patches are undone by it."""
    with _pending_lock:
        _pending.clear()
