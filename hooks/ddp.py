"""DDP gradient buckets as collectives: ``wrap(hook)`` returns a communication hook that records
each bucket as one ``all_reduce`` (pre- and post-hooks, c10d's sequence number of the collective the
hook issues), leaving the hook's own collectives unrecorded (``DdpBucket.wire_bytes``). With
``instrument()`` on, a hookless model's buckets are recorded too. See docs/running.md.

Example::

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model.register_comm_hook(None, commlens.hooks.ddp.wrap(default_hooks.fp16_compress_hook))
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commlens.ring import _producer
from commlens.ring.layout import ERROR, NOT_ISSUED, OK
from commlens.ring.ops import OpName

from . import _issuing, extension, fingerprints, groups, issuing, process_ring, signatures
from .futures import then, when_done
from .patch import Patches
from .record import status_of
from .recorder import InFlight
from .registry import post_hooks
from ._state import state as hot_state


@dataclasses.dataclass
class DdpBucket:
    """What commlens knows of one gradient bucket; ``pre.bucket`` in the hook arguments."""

    index: int
    parameters: int
    is_last: bool
    nbytes: int
    step: int = 0
    """The backward passes of its model that ended (with their last bucket) before this bucket's."""
    wire_bytes: int = 0
    """Bytes the wrapped hook's own collectives carried (after compression); known once it returned."""
    exponent: int | None = None
    """The largest binary exponent among its values, where the C++ hook's pass over them found it (in START)."""


class Steps:
    """The backward passes of one model (one registration of a hook) that have ended: the ``step`` of
    its next bucket. A model's last bucket of a pass (``is_last``) ends it."""

    __slots__ = ("ended",)

    def __init__(self) -> None:
        self.ended = 0

    def of(self, is_last: bool) -> int:
        step = self.ended
        self.ended += is_last
        return step


_scope = threading.local()
"""``bucket`` is set while a wrapped hook runs: collectives it issues add to it, unrecorded."""
_active_lock = threading.Lock()


def nested_collective(tensors: tuple, output_tensors: tuple) -> bool:
    """True (and its bytes counted) for a collective issued by a wrapped hook on this thread."""
    bucket = getattr(_scope, "bucket", None)
    if bucket is None:
        return False
    bucket.wire_bytes += signatures.signature(tensors, output_tensors)[1]
    return True


def wrap(hook: Callable | None = None) -> Callable:
    """``hook`` (default: ``allreduce_hook``, recorded by ``recorded_allreduce()``) recording every bucket
    it reduces; register it with one model (its buckets' steps are counted for that model)."""
    if hook is None:
        return recorded_allreduce()
    if getattr(hook, "_commlens_wrapped", False):
        return hook
    if not callable(hook):
        raise TypeError(f"wrap() takes a DDP communication hook hook(state, bucket) -> Future; got {hook!r}")
    steps = Steps()

    @functools.wraps(hook)
    def recorded(state: Any, bucket: Any):
        flight = _start(state, bucket, steps)
        if flight is None:
            return hook(state, bucket)
        with _active_lock:  # hot_state.ddp_active: wrapped hooks running now, in any thread (the wrappers look further)
            hot_state.ddp_active += 1
        _scope.bucket = flight.bucket
        seq_source = flight.group.seq_source
        seq_before = seq_source() if seq_source is not None else None
        try:
            future = issuing.issue(flight, hook, state, bucket)
        finally:
            _scope.bucket = None
            with _active_lock:
                hot_state.ddp_active -= 1
        if not isinstance(future, torch._C.Future):  # DDP raises its own error for this
            flight.complete(ERROR, TypeError(f"communication hook returned {type(future).__name__}"))
            return future
        if seq_before is not None and seq_source() == seq_before:  # e.g. noop_hook: no collective, no seq of its own
            flight.complete(NOT_ISSUED, None)
            return future
        if flight.gpu is not None:  # a bucket on a CUDA device completes when the GPU has reduced it
            flight.gpu_end(future)
        elif fingerprints.due(flight.code, flight.seq):  # DDP gets the hook's result once it is fingerprinted
            return then(future, functools.partial(_completed_with_result, flight))
        else:
            when_done(future, flight._future_done)
        return future

    recorded._commlens_wrapped = True
    return recorded


def _completed_with_result(flight: InFlight, done: Any) -> Any:
    """The hook's result, ``flight`` completed first with it as its output (what the hook's future holds,
    whatever the bucket's buffer holds); the hook's error raised on, to DDP."""
    try:
        value = done.value()
    except Exception as error:
        flight.complete(status_of(error), error)
        raise
    flight.output_tensors = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    flight.complete(OK, None)
    return value


def recorded_allreduce() -> Callable:
    """``allreduce_hook`` recording its bucket, a hook for one model: what a hookless model runs under
    ``instrument()``. It
    issues torch's own all_reduce (the bucket's collective is this record), asks c10d for nothing more
    (each call lets go of the GIL, which gloo's thread, running a callback, may then hold), and on a
    CPU writes END in the one callback that hands DDP its bucket. On a CUDA device all of it (the
    record's events, the NaN check's sum, the all_reduce's issue) goes on a side stream that waits for
    the current one: the backward pass goes on while the check reads the bucket, and the all_reduce,
    whose stream waits for the side stream, starts once it has."""
    steps = Steps()

    def recorded(state: Any, bucket: Any):
        buffer = bucket.buffer()
        if buffer.is_cuda:
            side = _side_stream(buffer.device)
            side.wait_stream(torch.cuda.current_stream(buffer.device))
            with torch.cuda.stream(side):
                return _recorded_allreduce(state, bucket, steps)
        return _recorded_allreduce(state, bucket, steps)

    recorded._commlens_wrapped = True
    return recorded


@functools.cache
def _side_stream(device: torch.device) -> Any:
    """DDP's buckets' stream on ``device`` (not ``cuda.py``'s, which waits for collectives to end)."""
    return torch.cuda.Stream(device)


def _recorded_allreduce(state: Any, bucket: Any, steps: Steps):
    flight = _start(state, bucket, steps)
    if flight is None:
        return allreduce_hook(state, bucket)
    future = issuing.issue(flight, allreduce_hook, state, bucket, flight)
    if flight.gpu is not None:  # a bucket on a CUDA device completes when the GPU has reduced it
        flight.gpu_end(future)
    return future



def _start(state: Any, bucket: Any, steps: Steps) -> InFlight | None:
    """START of a bucket's all_reduce, its pre-hooks run; None: it goes on unrecorded."""
    return _begin(_process_group(state), bucket.buffer(), bucket.index(), len(bucket.parameters()), bucket.is_last(),
                  steps=steps)


def _begin(pg: Any, buffer: torch.Tensor, index: int, parameters: int, is_last: bool,
           finite: bool | None = None, exponent: int | None = None, *, steps: Steps) -> InFlight | None:
    step = steps.of(is_last)
    try:
        group = groups.group_of(pg)
    except Exception as error:  # commlens could not record it: the bucket goes on unrecorded
        process_ring.internal_error("ddp bucket", error)
        return None
    info = DdpBucket(index, parameters, is_last, buffer.numel() * buffer.element_size(), step, exponent=exponent)
    tensors = (buffer,)
    return issuing.start(OpName.all_reduce, group, tensors, tensors, True, None, None, bucket=info,
                          inputs_finite=finite is True)


def _begin_in_cpp(pg: Any, buffer: torch.Tensor, index: int, parameters: int, is_last: bool,
                  finite: bool | None, exponent: int | None, *, steps: Steps) -> tuple | None:
    """``begin`` of the C++ hook (one model's, ``steps`` bound): START of a bucket it has divided,
    ``finite`` when its pass proved every element finite (the NaN check is then left out), ``exponent``
    the largest among them; what it needs to end it (``_ddp_hook.cpp``)."""
    flight = _begin(pg, buffer, index, parameters, is_last, finite, exponent, steps=steps)
    if flight is None:
        return None
    flight.bucket.wire_bytes = flight.bucket.nbytes
    producer = None if post_hooks.entries else process_ring.ring().producer  # post-hooks run in Python
    due = fingerprints.due(flight.code, flight.seq) and producer is not None  # else complete() writes it
    return _end_in_python, flight, producer, flight.end_args(), flight.fingerprint_args() if due else None


def _end_in_python(flight: InFlight, error: str | None) -> None:
    if error is None:
        flight.complete(OK, None)
    else:
        flight.failed(RuntimeError(error))


@functools.cache
def cpp_hook() -> Any:
    """The C++ hook (``_ddp_hook.cpp``) for this torch, loaded or built on first call; None where it
    cannot be built, with a warning."""
    return extension.load_or_warn(
        "_ddp_hook.cpp", "C++ hook",
        "records DDP gradient buckets with a Python communication hook, about 100 µs more per bucket",
        lambda module: module.init(_issuing.set, _producer.write_record, _producer.write_record_at))


def _record_buckets(model: DistributedDataParallel, reducer: Any) -> None:
    """Record a hookless model's buckets: by the C++ hook on CPU, else by ``recorded_allreduce``."""
    hook = cpp_hook() if model.device_type == "cpu" else None
    if hook is not None:
        try:
            hook.register_hook(reducer, model.process_group, functools.partial(_begin_in_cpp, steps=Steps()))
            return
        except Exception as error:  # e.g. a reducer this torch binds differently: the Python hook records
            process_ring.internal_error("ddp C++ hook", error)
    dist._register_comm_hook(reducer, model.process_group, recorded_allreduce())


def allreduce_hook(process_group: Any, bucket: Any, flight: InFlight | None = None) -> torch.futures.Future:
    """PyTorch's ``allreduce_hook`` — the bucket divided by the group's size, then all-reduced — with
    its callback, which runs on the backend's thread, followed so that the process waits for it at exit.
    On NCCL the division is the all_reduce's own (a pre-multiplied sum, as DDP without a hook multiplies
    by 1 / size in its copy into the bucket), not a pass of its own over the bucket; in a group of one
    there is none. With ``flight`` (``recorded_allreduce``) it issues torch's all_reduce, not our
    wrapper, and on a CPU that callback completes ``flight`` first."""
    group = process_group if process_group is not None else dist.group.WORLD
    tensor, op, size = bucket.buffer(), dist.ReduceOp.SUM, group.size()
    if size > 1 and tensor.is_cuda and dist.get_backend(group) == "nccl":
        op = dist._make_nccl_premul_sum(1.0 / size)
    elif size > 1:
        tensor.div_(size)
    if flight is None:
        return then(dist.all_reduce(tensor, op, group=group, async_op=True).get_future(), lambda done: done.value()[0])
    flight.bucket.wire_bytes = flight.bucket.nbytes
    future = getattr(dist.all_reduce, "__wrapped__", dist.all_reduce)(tensor, op, group=group,
                                                                      async_op=True).get_future()
    if flight.gpu is not None:
        return then(future, lambda done: done.value()[0])

    def reduced(done: Any) -> torch.Tensor:
        flight._future_done(done)
        return done.value()[0]
    return then(future, reduced)


def _process_group(state: Any) -> Any:
    return state if isinstance(state, dist.ProcessGroup) else getattr(state, "process_group", None)


_hooked: weakref.WeakSet = weakref.WeakSet()
"""DDP models that registered a communication hook of their own, Python or built-in."""
_started: weakref.WeakSet = weakref.WeakSet()
"""DDP models that have run a forward under commlens."""


def instrument_ddp(patches: Patches) -> None:
    """Add the patches that wrap every hook registered from now on and record hookless models."""
    cpp_hook()  # built now (once per machine), not in a model's first forward

    def register_comm_hook(original):
        def register_comm_hook(self, state, hook):
            _hooked.add(self)
            if not callable(hook) or getattr(hook, "_commlens_wrapped", False):
                return original(self, state, hook)
            recorded = wrap(hook)
            result = original(self, state, recorded)  # DDP checks the hook through ``__wrapped__``
            if self._comm_hooks and self._comm_hooks[-1][0] is recorded:
                self._comm_hooks[-1] = (hook, state)  # the model holds the user's hook, as without commlens
            return result

        return register_comm_hook

    def register_builtin_comm_hook(original):
        def _register_builtin_comm_hook(self, comm_hook_type):
            _hooked.add(self)
            return original(self, comm_hook_type)

        return _register_builtin_comm_hook

    def pre_forward(original):
        def _pre_forward(self, *inputs, **kwargs):
            if self not in _started:
                _started.add(self)
                reducer = getattr(self, "reducer", None)
                if self not in _hooked and not self._comm_hooks and reducer is not None \
                        and not getattr(self, "_use_python_reducer", False):
                    _hooked.add(self)
                    _record_buckets(self, reducer)
            return original(self, *inputs, **kwargs)

        return _pre_forward

    patches.add(DistributedDataParallel.register_comm_hook, register_comm_hook,
                "DistributedDataParallel.register_comm_hook")
    patches.add(DistributedDataParallel._register_builtin_comm_hook, register_builtin_comm_hook,
                "DistributedDataParallel._register_builtin_comm_hook")
    patches.add(DistributedDataParallel._pre_forward, pre_forward, "DistributedDataParallel._pre_forward")
