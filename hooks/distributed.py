"""Instrumentation of the public ``torch.distributed`` collectives and point-to-point ops.

PyTorch 2.13 has no hook API for them, so ``instrument()`` wraps each one in place:

* functions that c10d decorates with its exception logger (all collectives, ``send``, ``recv``)
  keep their public object; the decorated function inside it is swapped for ours;
* ``isend``, ``irecv`` and ``destroy_process_group`` keep their function object too; its code is
  forwarded to ours.

So code that bound ``from torch.distributed import all_reduce`` before ``instrument()`` is covered,
and ``batch_isend_irecv`` (which calls ``isend``/``irecv`` and checks their identity) records each
of its ops. ``uninstrument()`` restores everything. Both are safe to repeat.

Example::

    import commlens.hooks as ch
    ch.instrument()
    dist.all_reduce(t)   # pre-hooks, START, the all_reduce, END, post-hooks
    ch.uninstrument()
"""

from __future__ import annotations

import threading
import types
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import ddp, recorder, registry
from .ops import OpName
from .recorder import Group


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


def _all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    return group, async_op, (input_tensor,), (output_tensor,), None, None


def _reduce_scatter(output, input_list, op=None, group=None, async_op=False):
    return group, async_op, tuple(input_list), (output,), None, None


def _reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
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
    "all_gather_into_tensor": (OpName.all_gather_into_tensor, _all_gather_into_tensor),
    "reduce_scatter": (OpName.reduce_scatter, _reduce_scatter),
    "reduce_scatter_tensor": (OpName.reduce_scatter_tensor, _reduce_scatter_tensor),
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

_NOT_MEMBER = object()
_groups: dict[Any, Any] = {}
"""Process group (None for the default one) -> its recorder ``Group``, or _NOT_MEMBER."""


def group_of(handle: Any) -> Any:
    """Register ``handle`` (None: the default group); every handle of one group shares its Group."""
    pg = c10d._get_default_group() if handle is None else handle
    found = _groups.get(pg)
    if found is None:
        if c10d._rank_not_in_group(pg):
            found = _NOT_MEMBER
        else:
            try:
                pg._get_sequence_number_for_group()
                seq_source = pg._get_sequence_number_for_group
            except (AttributeError, RuntimeError):
                seq_source = None
            found = Group(pg, c10d._get_process_group_name(pg), getattr(pg, "group_desc", "undefined"),
                          c10d.get_process_group_ranks(pg), dist.get_rank(), str(dist.get_backend(pg)),
                          seq_source)
        _groups[pg] = found
    _groups[handle] = found
    return found


_sync_p2p = threading.local()
"""``active`` is set while a sync ``send``/``recv`` runs: they call ``isend``/``irecv`` inside,
which must not be recorded a second time."""


def _instrumented(op: OpName, original: Callable, describe: Callable, kind: str = "collective") -> Callable:
    rooted = not op.is_p2p
    code = recorder.CODE[op]
    unhooked_ok = kind == "collective"

    def collective(*args, **kwargs):
        if kind == "async_p2p" and getattr(_sync_p2p, "active", False):
            return original(*args, **kwargs)
        try:
            group, async_op, tensors, outputs, target, group_target = describe(*args, **kwargs)
            info = _groups.get(group) or group_of(group)
        except Exception:  # bad arguments or no process group: torch says so itself
            return original(*args, **kwargs)
        if info is _NOT_MEMBER or (ddp.active and ddp.nested_collective(tensors, outputs)):
            return original(*args, **kwargs)
        if group_target is None and target is not None:
            group_target = info.group_rank(target)
        if unhooked_ok and not async_op and not registry.hooked:
            return recorder.run_unhooked(code, info, tensors, outputs, -1 if group_target is None else group_target,
                                         original, args, kwargs)
        try:
            flight = recorder.begin(op, info, tensors, outputs, async_op,
                                    group_target if rooted else None, None if rooted else group_target)
        except recorder.HookRaised as raised:
            raise raised.error from None
        except Exception as error:
            recorder.internal_error("begin", error)
            return original(*args, **kwargs)
        try:
            if kind == "sync_p2p":
                _sync_p2p.active = True
                try:
                    result = original(*args, **kwargs)
                finally:
                    _sync_p2p.active = False
            else:
                result = original(*args, **kwargs)
        except BaseException as error:
            flight.failed(error)
            raise
        try:
            flight.issued(result)
        except recorder.HookRaised as raised:
            raise raised.error from None
        except Exception as error:
            recorder.internal_error("issued", error)
        return result

    collective.__wrapped__ = original
    return collective


def _destroy_process_group(original: Callable) -> Callable:
    def destroy_process_group(*args, **kwargs):
        _groups.clear()
        return original(*args, **kwargs)

    return destroy_process_group


def _trampoline(*args, _commlens_target=None, **kwargs):
    return _commlens_target(*args, **kwargs)


class _Patch:
    """One in-place replacement, undone by ``undo()``."""

    def __init__(self, public: Callable, make: Callable[[Callable], Callable]):
        code = public.__code__
        if "func" in code.co_freevars:  # c10d's logging decorator: swap the function it wraps
            self._cell = public.__closure__[code.co_freevars.index("func")]
            self._saved = self._cell.cell_contents
            self._cell.cell_contents = make(self._saved)
        else:  # a plain function: keep the object, forward its code to the wrapper
            self._cell, self._function = None, public
            self._saved = (code, public.__defaults__, public.__kwdefaults__)
            original = types.FunctionType(code, public.__globals__, public.__name__, public.__defaults__,
                                          public.__closure__)
            original.__kwdefaults__ = public.__kwdefaults__
            public.__code__, public.__defaults__ = _trampoline.__code__, None
            public.__kwdefaults__ = {"_commlens_target": make(original)}

    def undo(self) -> None:
        if self._cell is not None:
            self._cell.cell_contents = self._saved
        else:
            f = self._function
            f.__code__, f.__defaults__, f.__kwdefaults__ = self._saved


_patches: list[_Patch] = []
_lock = threading.Lock()


def instrument() -> None:
    """Record every public torch.distributed collective and p2p op from now on. Idempotent."""
    with _lock:
        if _patches:
            return
        for name, (op, describe) in _DESCRIBE.items():
            kind = {"send": "sync_p2p", "recv": "sync_p2p", "isend": "async_p2p", "irecv": "async_p2p"}.get(name, "collective")
            _patches.append(_Patch(getattr(c10d, name), lambda original, op=op, describe=describe, kind=kind:
                                   _instrumented(op, original, describe, kind)))
        _patches.append(_Patch(c10d.destroy_process_group, _destroy_process_group))
        ddp.instrument_ddp()


def uninstrument() -> None:
    """Restore torch.distributed exactly as it was. Idempotent."""
    with _lock:
        while _patches:
            _patches.pop().undo()
        ddp.uninstrument_ddp()
        _groups.clear()


def is_instrumented() -> bool:
    return bool(_patches)
