"""Feeding torchcomms communicators into commlens through their own hook API (duck-typed: the v0.2
``pre(args)`` and v0.3 ``pre(name, op_id, args)`` forms, ``abort()``). Each op becomes a collective
like any other, numbered per communicator. See docs/hooks.md.

Example::

    handle = attach(comm)      # what NanCheckHook / FlightRecorderHook.register_with_comm(comm) do
    ...
    handle.remove()
"""

from __future__ import annotations

from typing import Any, Callable

from commlens.ring.layout import ERROR, OK
from commlens.ring.ops import OpName

from . import issuing, process_ring
from .ops import PostHookArgs
from .record import Group
from .recorder import InFlight
from .registry import _Hooks

_ALIASES = {"all_gather_single": OpName.all_gather_into_tensor,
            "reduce_scatter_single": OpName.reduce_scatter_tensor,
            "allreduce": OpName.all_reduce, "allgather": OpName.all_gather, "alltoall": OpName.all_to_all}


def _op_name(name: Any) -> OpName | None:
    text = str(getattr(name, "name", name)).rsplit(".", 1)[-1].lower()
    try:
        return _ALIASES.get(text) or OpName(text)
    except ValueError:
        return None


def _tensors(args: Any, *names: str) -> tuple:
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            return tuple(value) if isinstance(value, (list, tuple)) else (value,)
    return ()


FLIGHTS_MAX = 65536
"""Collectives of one communicator between pre- and post-hook kept at most."""


class CommSource:
    """One attached communicator: translates its callbacks into the issuing protocol's halves."""

    def __init__(self, comm: Any):
        self.comm = comm
        rank, size = int(comm.get_rank()), int(comm.get_size())
        name = str(comm.get_name()) if hasattr(comm, "get_name") else f"torchcomm-{id(comm):x}"
        backend = str(comm.get_backend()) if hasattr(comm, "get_backend") else "nccl"
        self.group = Group(comm, name, name, list(range(size)), rank, backend)
        self.pre_hooks, self.post_hooks = _Hooks("pre"), _Hooks("post")
        self._flights: dict[Any, InFlight] = {}
        self._users = 0
        self._handles = [comm.register_pre_hook(self._pre), comm.register_post_hook(self._post),
                         comm.register_abort_hook(self._abort)]

    def _pre(self, *callback: Any) -> None:
        name, op_id, args = (callback[0].name, callback[0].op_id, callback[0]) if len(callback) == 1 else callback
        op = _op_name(name)
        if op is None:  # not a collective commlens records (a split, a window)
            return
        inputs = _tensors(args, "input_tensors", "tensors", "input_tensor", "tensor")
        outputs = _tensors(args, "output_tensors", "output_tensor") or inputs
        target = getattr(args, "root", None) if not op.is_p2p else getattr(args, "peer", None)
        flight = issuing.start(op, self.group, inputs, outputs, bool(getattr(args, "async_op", False)),
                               None if op.is_p2p else target, target if op.is_p2p else None)
        if flight is None:  # commlens could not record it: counted
            return
        self._flights[op_id] = flight
        flights = self._flights  # one dict throughout: an abort on another thread may replace it
        if len(flights) > FLIGHTS_MAX:  # a post-hook that never came: bounded, completed and counted
            try:
                lost = flights.pop(next(iter(flights)))
            except (StopIteration, KeyError, RuntimeError):  # emptied or changed meanwhile: nothing to let go
                lost = None
            if lost is not None:
                process_ring.count_error("work_unjudged")
                lost.complete(OK, None)
        self.pre_hooks.call(flight)

    def _post(self, *callback: Any) -> None:
        op_id, args = (callback[0].op_id, callback[0]) if len(callback) == 1 else callback[1:]
        flight = self._flights.pop(op_id, None)
        if flight is None:
            return
        flight.work = getattr(args, "work", None)
        issuing.settle(self._completed, flight)

    def _completed(self, flight: InFlight) -> None:
        end = flight.complete(OK, None)
        if self.post_hooks.entries:
            self.post_hooks.call(PostHookArgs(flight, flight.work, "ok", None, flight.t0, end))

    def _abort(self, *_: Any) -> None:
        error = RuntimeError(f"torchcomms communicator {self.group.name!r} aborted")
        flights, self._flights = self._flights, {}
        for flight in flights.values():
            flight.complete(ERROR, error)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        _sources.pop(id(self.comm), None)


_sources: dict[int, CommSource] = {}


class AttachHandle:
    """What ``attach`` returns; ``remove()`` undoes that attachment (idempotent)."""

    def __init__(self, source: CommSource, pre: Callable | None, post: Callable | None, propagate: bool):
        self.source, self.group = source, source.group
        self._handles = [h.add(f, propagate) for h, f in ((source.pre_hooks, pre), (source.post_hooks, post)) if f]
        source._users += 1
        self._live = True

    def remove(self) -> None:
        if not self._live:
            return
        self._live = False
        for handle in self._handles:
            handle.remove()
        self.source._users -= 1
        if self.source._users == 0:
            self.source.detach()


def attach(comm: Any, pre: Callable | None = None, post: Callable | None = None,
           propagate: bool = False) -> AttachHandle:
    """Record ``comm``'s collectives, calling ``pre``/``post`` for this comm only as well as commlens'
    global hooks (``propagate``: their exceptions reach the communicator's caller). A communicator
    is attached once however many hooks use it."""
    for method in ("register_pre_hook", "register_post_hook", "register_abort_hook", "get_rank", "get_size"):
        if not callable(getattr(comm, method, None)):
            raise TypeError(f"register_with_comm() takes a torchcomms communicator (with register_pre_hook, "
                            f"register_post_hook, register_abort_hook, get_rank, get_size) or a torch.distributed "
                            f"process group; {type(comm).__name__} has no {method}()")
    source = _sources.get(id(comm)) or _sources.setdefault(id(comm), CommSource(comm))
    return AttachHandle(source, pre, post, propagate)
