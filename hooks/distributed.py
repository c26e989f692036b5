"""Instrumentation of the public ``torch.distributed`` collectives and point-to-point ops, wrapped
in place (``patch.Patch``); ``instrument()`` also covers DDP's hooks (``ddp``), the functional
collectives (``functional``) and PyTorch's process-group hooks (``native``). ``uninstrument()``
restores everything; both are safe to repeat. See docs/hooks.md.

Example::

    import commlens.hooks as ch
    ch.instrument()
    dist.all_reduce(t)   # pre-hooks, START, the all_reduce, END, post-hooks
    ch.uninstrument()
"""

from __future__ import annotations

import inspect
import threading
from typing import Callable

import torch
import torch.distributed.distributed_c10d as c10d

from commlens.ring.ops import CODE, OpName

from . import (cuda, ddp, extension, finite, functional, futures, groups, issuing, native, poller, process_ring, record,
               recorder, signatures)
from ._all_reduce import AllReduce
from ._state import state
from .patch import Patches, PatchError


# Each mirrors the signature of the torch.distributed function of the same name and returns
# (group, async_op, input tensors, output tensors, root or peer as a global rank, ... as a group rank).
def _all_reduce(tensor, op=None, group=None, async_op=False):
    tensors = (tensor,)
    return group, async_op, tensors, tensors, None, None


def _broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    tensors = (tensor,)
    return group, async_op, tensors, tensors, src, group_src


def _reduce(tensor, dst=None, op=None, group=None, async_op=False, group_dst=None):
    tensors = (tensor,)
    return group, async_op, tensors, tensors, dst, group_dst


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    return group, async_op, (tensor,), tuple(tensor_list), None, None


def _all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
    return group, async_op, (input_tensor,), (output_tensor,), None, None


def _reduce_scatter(output, input_list, op=None, group=None, async_op=False):
    return group, async_op, tuple(input_list), (output,), None, None


def _reduce_scatter_single(output, input, op=None, group=None, async_op=False):
    return group, async_op, (input,), (output,), None, None


def _all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    return group, async_op, tuple(input_tensor_list), tuple(output_tensor_list), None, None


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                       async_op=False):
    return group, async_op, (input,), (output,), None, None


def _gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    return group, async_op, (tensor,), tuple(gather_list or ()), dst, group_dst


def _scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    return group, async_op, tuple(scatter_list or ()), (tensor,), src, group_src


def _barrier(group=None, async_op=False, device_ids=None, timeout=None):
    return group, async_op, (), (), None, None


def _send(tensor, dst=None, group=None, tag=0, group_dst=None):
    return group, False, (tensor,), (), dst, group_dst


def _recv(tensor, src=None, group=None, tag=0, group_src=None):
    return group, False, (), (tensor,), src, group_src


def _isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return group, True, (tensor,), (), dst, group_dst


def _irecv(tensor, src=None, group=None, tag=0, group_src=None):
    return group, True, (), (tensor,), src, group_src


_DESCRIBE: dict[str, tuple[OpName, Callable[..., tuple]]] = {
    "all_reduce": (OpName.all_reduce, _all_reduce),
    "broadcast": (OpName.broadcast, _broadcast),
    "reduce": (OpName.reduce, _reduce),
    "all_gather": (OpName.all_gather, _all_gather),
    "all_gather_single": (OpName.all_gather_into_tensor, _all_gather_single),
    "reduce_scatter": (OpName.reduce_scatter, _reduce_scatter),
    "reduce_scatter_single": (OpName.reduce_scatter_tensor, _reduce_scatter_single),
    "all_to_all": (OpName.all_to_all, _all_to_all),
    "all_to_all_single": (OpName.all_to_all_single, _all_to_all_single),
    "gather": (OpName.gather, _gather),
    "scatter": (OpName.scatter, _scatter),
    "barrier": (OpName.barrier, _barrier),
    "send": (OpName.send, _send),
    "recv": (OpName.recv, _recv),
    "isend": (OpName.send, _isend),
    "irecv": (OpName.recv, _irecv),
}

_BEFORE_2_13 = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
"""Before PyTorch 2.13 the ``*_single`` functions were not there, and their aliases were the functions."""
_KINDS = {"send": "sync_p2p", "recv": "sync_p2p", "isend": "async_p2p", "irecv": "async_p2p"}
"""How a wrapped function issues (issuing.py); any other is a collective."""

_sync_p2p = threading.local()
"""``active`` is set while a sync ``send``/``recv`` runs: they call ``isend``/``irecv`` inside,
which must not be recorded a second time."""


def _instrumented(op: OpName, original: Callable, describe: Callable, kind: str = "collective") -> Callable:
    rooted = not op.is_p2p
    code = CODE[op]
    unhooked_ok = kind == "collective"
    issue = _marking_sync_p2p(original) if kind == "sync_p2p" else original

    def recorded(*args, **kwargs):
        if kind == "async_p2p" and getattr(_sync_p2p, "active", False):
            return original(*args, **kwargs)
        try:
            group, async_op, tensors, outputs, target, group_target = describe(*args, **kwargs)
            info = groups.known.get(group) or groups.group_of(group)
        except Exception:  # bad arguments or no process group: torch says so itself
            return original(*args, **kwargs)
        if info is groups.NOT_MEMBER or (state.ddp_active and ddp.nested_collective(tensors, outputs)):
            return original(*args, **kwargs)
        if group_target is None and target is not None:
            group_target = info.group_rank(target)
        if unhooked_ok and not async_op and not state.hooked:
            result = recorder.run_unhooked(code, info, tensors, outputs, -1 if group_target is None else group_target,
                                           original, args, kwargs, state.checking_inputs)
            if result is not recorder.UNPROVEN:
                return result
        return issuing.record(op, info, tensors, outputs, async_op, group_target if rooted else None,
                              None if rooted else group_target, issue, args, kwargs)

    chosen = issuing.stepping_aside(recorded) if native.AVAILABLE else recorded  # before 2.14 nothing steps aside
    chosen.__wrapped__ = original
    return chosen


def _marking_sync_p2p(original: Callable) -> Callable:
    """A sync ``send``/``recv`` that marks itself running, so that the ``isend``/``irecv`` it calls
    is not recorded a second time."""

    def sync_p2p(*args, **kwargs):
        _sync_p2p.active = True
        try:
            return original(*args, **kwargs)
        finally:
            _sync_p2p.active = False

    return sync_p2p


def _wrapper(op: OpName, original: Callable, describe: Callable, kind: str) -> Callable:
    general = _instrumented(op, original, describe, kind)
    return _all_reduce_in_c(original, general) if op is OpName.all_reduce else general


def _all_reduce_in_c(original: Callable, general: Callable) -> Callable:
    """``all_reduce`` with its common case in C (``_all_reduce.c``; the training thread's cost:
    docs/performance.md): synchronous, one tensor (on a GPU where the GPU extension is built), a known
    group, no hooks but the NaN check's, outside a DDP bucket. It records what ``recorder.run_unhooked``
    records, START and END; every other case goes to ``general``."""
    parameters = inspect.signature(original).parameters
    if list(parameters) != ["tensor", "op", "group", "async_op"]:  # another torch's all_reduce: no shortcut
        return general
    return AllReduce(original, general, parameters["op"].default, CODE[OpName.all_reduce], native.AVAILABLE,
                     groups.known, groups.NOT_MEMBER, signatures.in_place, signatures.describe_in_place,
                     finite.scanned, record.new_op_id, recorder.failed_unhooked, process_ring.internal_error,
                     process_ring.count_error, gpu=_gpu_api())


def _gpu_api() -> tuple | None:
    """The C all_reduce's way to CUDA tensors (``_gpu.h``), where the GPU extension is built."""
    gpu = cuda.native() if torch.cuda.is_available() else None
    return None if gpu is None else (gpu.api, torch._C._cuda_isCurrentStreamCapturing, torch.strided)


def _destroy_process_group(original: Callable) -> Callable:
    def destroy_process_group(group=None, *args, **kwargs):
        groups.known.clear()
        native.forget(group)
        futures.wait_for_callbacks(grace_s=0.0)  # see uninstrument
        return original(group, *args, **kwargs)

    return destroy_process_group


_patches = Patches()
_lock = threading.Lock()


def instrument() -> None:
    """Record every public torch.distributed collective and p2p op from now on. Idempotent.

    All or nothing: if any function cannot be patched, everything patched so far is undone and a
    ``PatchError`` names the function."""
    with _lock:
        if _patches:
            return
        try:
            for name, (op, describe) in _DESCRIBE.items():
                kind = _KINDS.get(name, "collective")
                name = name if hasattr(c10d, name) else _BEFORE_2_13[name]
                _patches.add(getattr(c10d, name), lambda original, op=op, describe=describe, kind=kind:
                             _wrapper(op, original, describe, kind), f"torch.distributed.{name}")
            _patches.add(c10d.destroy_process_group, _destroy_process_group, "torch.distributed.destroy_process_group")
            _patches.add((c10d.Work, "wait"), poller.waited, "torch.distributed.Work.wait")
            ddp.instrument_ddp(_patches)
            functional.instrument_functional(_patches)
            native.attach()
        except PatchError:
            _patches.undo()
            native.detach()
            raise


def build_extensions() -> None:
    """Load commlens' C++ extensions for this torch, building them on first use (about 25 s each):
    before a job's ranks start, which would otherwise each build them while their peers' hang
    clocks run (``commlens run``, ``commlens demo``); marked ready where every one loads."""
    if (native.forwarder() is not None or not native.AVAILABLE) and ddp.cpp_hook() is not None and \
            (not torch.cuda.is_available() or cuda.native() is not None):  # the GPU's only where there is one
        extension.mark_ready()


def uninstrument() -> None:
    """Restore torch.distributed exactly as it was, once commlens' callbacks on completed futures have
    left the backend's threads (at most ``futures.EXIT_WAIT_S``): one dropped there holding a group's
    last reference kills the process (docs/testing.md, "Resource deadlock avoided"). Idempotent."""
    futures.wait_for_callbacks(grace_s=0.0)
    with _lock:
        _patches.undo()
        native.detach()
        functional.uninstrument_functional()
        groups.known.clear()


def is_instrumented() -> bool:
    return bool(_patches)
