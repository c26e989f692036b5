"""PyTorch's own process-group hooks (torch >= 2.14): the collectives commlens' wrappers cannot reach
(compiled, C++-issued). ``attach()`` registers commlens' hooks (``HOOK_ID``) on every group, later ones
too, from C++ where ``_pg_hooks.cpp`` builds (else from Python); a collective a wrapper records
already is left to it. See docs/hooks.md.

Example::

    native.attach()      # instrument() does this where torch has the hooks
    ...
    native.detach()
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from typing import Any, Callable

import torch
import torch.distributed.distributed_c10d as c10d

from commlens.ring.ops import OpName

from . import _issuing, extension, groups, issuing, process_ring, recorder
from .patch import Patches
from .recorder import InFlight

HOOK_ID = 0x434C4E53
"""'CLNS': below the ids of PyTorch's own hooks ('FREC', 'NANC', 'HEAL'), so that where they run in
id order (2.15) commlens records a collective before PyTorch's NaN check may refuse it."""
AVAILABLE = hasattr(c10d.ProcessGroup, "register_pre_hook")

_OPS = {
    "ALLREDUCE": OpName.all_reduce, "ALLREDUCE_COALESCED": OpName.all_reduce,
    "BROADCAST": OpName.broadcast, "REDUCE": OpName.reduce,
    "ALLGATHER": OpName.all_gather, "ALLGATHER_COALESCED": OpName.all_gather,
    "ALLGATHER_BASE": OpName.all_gather_into_tensor, "ALLGATHER_INTO_TENSOR_COALESCED": OpName.all_gather_into_tensor,
    "REDUCE_SCATTER": OpName.reduce_scatter, "REDUCE_SCATTER_BASE": OpName.reduce_scatter_tensor,
    "REDUCE_SCATTER_TENSOR_COALESCED": OpName.reduce_scatter_tensor,
    "ALLTOALL": OpName.all_to_all, "ALLTOALL_BASE": OpName.all_to_all_single,
    "GATHER": OpName.gather, "SCATTER": OpName.scatter, "BARRIER": OpName.barrier,
    "SEND": OpName.send, "RECV": OpName.recv,
}
"""Hook op names -> commlens' ops; others (SPLIT, NEW_WINDOW, UNKNOWN) are not collectives we record."""
_SINGLE = {OpName.all_gather: OpName.all_gather_into_tensor, OpName.reduce_scatter: OpName.reduce_scatter_tensor,
           OpName.all_to_all: OpName.all_to_all_single}
"""Before 2.15 the tensor forms report under the list form's name: one input and one output tell them."""
_IN_PLACE = {OpName.all_reduce, OpName.broadcast, OpName.reduce}


class _GroupHooks:
    """commlens' hooks on one process group, and its collectives between pre- and post-hook."""

    def __init__(self, pg: Any):
        self.pg = pg
        self.key = next(_keys)
        self.pending: dict[int, InFlight] = {}
        """The group's op id -> its collective, from the pre-hook to the post-hook."""

    def pre(self, args: Any) -> bool:
        """Record the collective unless a wrapper does; whether it waits for ``post``."""
        if issuing.issuing():
            return False
        _settle_orphan()
        try:
            op = _OPS.get(args.name.name)
            if op is None or _capturing():
                return False
            info = groups.known.get(self.pg) or groups.group_of(self.pg)
            if info is groups.NOT_MEMBER:
                return False
            tensors, outputs = tuple(args.input_tensors), tuple(args.output_tensors)
            if op in _IN_PLACE and not outputs:  # PyTorch names no outputs for an in-place op
                outputs = tensors
            if op in _SINGLE and len(tensors) == 1 and len(outputs) == 1 and len(info.ranks) > 1:
                op = _SINGLE[op]
            target = args.root if args.root >= 0 else None
        except Exception as error:
            process_ring.internal_error("native pre-hook", error)
            return False
        flight = issuing.start(op, info, tensors, outputs, args.async_op, None if op.is_p2p else target,
                                target if op.is_p2p else None)  # a propagating hook's error reaches the caller
        if flight is None:
            return False
        self.pending[args.op_id] = flight
        _last.op = (self, args.op_id)
        return True

    def post(self, args: Any) -> None:
        _last.op = None
        flight = self.pending.pop(args.op_id, None)
        if flight is not None:
            issuing.settle(flight.issued, args.work, True)

    def abort(self) -> None:
        try:
            recorder.aborted(c10d._get_process_group_name(self.pg))
        except Exception as error:  # never into PyTorch's abort path
            process_ring.internal_error("native abort hook", error)


_last = threading.local()
"""``op``: (group hooks, op id) of the last collective this thread's pre-hook left for its post-hook."""


def _settle_orphan() -> None:
    """A thread's pre- and post-hooks of one collective come in turn: a collective still waiting for
    its post-hook when the thread's next pre-hook fires raised before it was queued (a backend
    error, PyTorch's NaN check refusing it). It failed: END with an error, not a false hang."""
    last = getattr(_last, "op", None)
    if last is None:
        return
    _last.op = None
    hooks, op_id = last
    flight = hooks.pending.pop(op_id, None)
    if flight is not None:
        issuing.settle(flight.failed, RuntimeError("the collective raised before it was queued"))


def _capturing() -> bool:
    """A CUDA graph is being captured: an event recorded now would invalidate the capture."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_keys = itertools.count(1)
_by_key: dict[int, _GroupHooks] = {}
"""Registered from C++: the key the forwarder passes -> the group's hooks."""


def _forward_pre(key: int, args: Any) -> bool:
    hooks = _by_key.get(key)
    return hooks is not None and hooks.pre(args)


def _forward_post(key: int, args: Any) -> None:
    hooks = _by_key.get(key)
    if hooks is not None:
        hooks.post(args)


@functools.cache
def forwarder() -> Any:
    """The C++ forwarder (``_pg_hooks.cpp``) for this torch, loaded or built on first call; None where
    it cannot be built, with a warning."""
    if not AVAILABLE:
        return None
    return extension.load_or_warn(
        "_pg_hooks.cpp", "C++ forwarder",
        "registers PyTorch's process-group hooks from Python, about 2 µs more per collective",
        lambda module: module.init(_issuing.now, _forward_pre, _forward_post))


_attached: dict[Any, _GroupHooks] = {}
_patches = Patches()
_lock = threading.Lock()


def attach() -> bool:
    """Register commlens' hooks on every process group, now and as groups are created; False where
    torch has no process-group hooks (before 2.14)."""
    if not AVAILABLE:
        return False
    with _lock:
        forwarder()
        if not _patches:
            _patches.add(c10d._register_pg_in_world, _registering, "torch.distributed._register_pg_in_world")
        for pg in list(c10d._world.pg_map):
            _attach(pg)
    return True


def detach() -> None:
    """Unregister every hook ``attach()`` registered and stop following new groups."""
    with _lock:
        _patches.undo()
        while _attached:
            _unregister(*_attached.popitem())


def forget(pg: Any) -> None:
    """``pg`` (every group when None) is being destroyed: its hooks go first, and nothing keeps it."""
    with _lock:
        for group in list(_attached) if pg is None else [pg]:
            hooks = _attached.pop(group, None)
            if hooks is not None:
                _unregister(group, hooks)


def _unregister(pg: Any, hooks: _GroupHooks) -> None:
    _by_key.pop(hooks.key, None)
    for unregister in (pg.unregister_pre_hook, pg.unregister_post_hook, pg.unregister_abort_hook):
        with contextlib.suppress(Exception):  # never registered (gloo's abort hook), or the group is gone already
            unregister(HOOK_ID)


def _attach(pg: Any) -> None:
    """Register on ``pg``; a group that refuses goes unrecorded by these hooks, counted, never failing
    the caller (``new_group``, ``instrument``)."""
    if pg in _attached or pg is None or pg is c10d.GroupMember.NON_GROUP_MEMBER:
        return
    hooks = _GroupHooks(pg)
    try:
        if forwarder() is not None:  # loaded by attach() already
            _by_key[hooks.key] = hooks
            forwarder().attach(pg, HOOK_ID, hooks.key)
        else:
            pg.register_pre_hook(HOOK_ID, hooks.pre)
            pg.register_post_hook(HOOK_ID, hooks.post)
    except Exception as error:
        _unregister(pg, hooks)
        process_ring.internal_error("process-group hooks", error)
        return
    _attached[pg] = hooks
    if getattr(pg, "supports_abort_hooks", True):  # 2.15 says; 2.14's gloo refuses
        with contextlib.suppress(Exception):
            pg.register_abort_hook(HOOK_ID, hooks.abort)


def _registering(original: Callable) -> Callable:
    def register_pg_in_world(pg, *args, **kwargs):
        result = original(pg, *args, **kwargs)
        with _lock:
            _attach(pg)  # counts its own failures: the group is made either way
        return result

    return register_pg_in_world
