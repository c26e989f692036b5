"""The hot path shared by every source of collectives: ring records and hook calls for one op.

A source (``torch.distributed`` wrappers, torchcomms communicators) describes a collective and calls
``begin()``; that runs the pre-hooks, writes START and returns the op's ``InFlight`` record. The
source then calls ``issued()`` with what the backend returned, or ``failed()`` with its exception.
Completion writes END and runs the post-hooks: at once for a synchronous op, from the work's future
or the completion poller for an async one — never by blocking the caller.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import warnings
import weakref
from typing import Any, Callable, NoReturn

from .ops import CODE, OPS, OpName, AbortHookArgs, PostHookArgs, PreHookArgs
from .registry import abort_hooks, post_hooks, pre_hooks
from . import _issuing, cuda, finite
from .futures import when_done
from .ring import END, ERROR, FLAG_ASYNC, FLAG_LAST_BUCKET, GPU_START, NAN, OK, START, STATUS, TIMEOUT, Ring


_op_ids = itertools.count(1)
_ring: Ring | None = None
where: Callable[[], int] | None = None
"""Set by ``attribution.enable()``: the ``(module << 8) | phase`` of a collective issued now."""
_ring_lock = threading.Lock()


new_op_id: Callable[[], int] = _op_ids.__next__
"""A fresh op id: larger than every id issued so far, smaller than every later one (C, no frame)."""


def ring() -> Ring:
    """This process's ring, created on first use from ``COMMLENS_RING_SLOTS`` / ``COMMLENS_RING_PATH``
    (unless the agent created it first, in a pod sidecar's folder: ``ring_at``)."""
    global _ring
    if _ring is None:
        with _ring_lock:
            if _ring is None:
                _ring = _ring_from_env()
    return _ring


def ring_at(path: str | None, slots: int) -> Ring:
    """This process's ring, created as the file ``path`` (None: private memory) with ``slots`` slots
    unless it exists (the agent's checked configuration wins over the environment's); a ValueError
    if the process already records into another ring."""
    global _ring
    with _ring_lock:
        if _ring is None:
            _ring = Ring(slots=slots, path=path)
        elif _ring.path != path:
            raise ValueError(f"commlens already records into {_ring.path or 'an anonymous ring'}, not {path!r}: "
                             "start commlens before anything else records collectives")
    return _ring


def _ring_from_env() -> Ring:
    raw = os.environ.get("COMMLENS_RING_SLOTS", "65536")
    try:
        slots = int(raw)
    except ValueError:
        slots = -1
    if slots < 2 or slots & (slots - 1):
        raise ValueError(f"COMMLENS_RING_SLOTS={raw!r} is not accepted: it must be a power of two >= 2")
    path = os.environ.get("COMMLENS_RING_PATH") or None
    if path and "{rank}" in path:
        path = path.format(rank=os.environ.get("RANK", "0"))
    return Ring(slots=slots, path=path)


issuing: Callable[[], bool] = _issuing.issuing
"""``issuing()`` is true on a thread while one of commlens' wrappers issues a collective it records
(or leaves unrecorded on purpose): PyTorch's own process-group hooks (``native.py``) then step aside.
``set_issuing(on)`` sets it and returns what it was (``_issuing.c``: C, read by ``_pg_hooks.cpp``)."""
set_issuing: Callable[[bool], bool] = _issuing.set_issuing


class HookRaised(Exception):
    """A propagating pre- or post-hook raised ``error``; the source re-raises it to the caller."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    def reraise(self) -> NoReturn:
        """Raise ``error`` as it is, leaving no reference cycle between the two exceptions: the
        error, and what its traceback's frames hold (the op's tensors, its process group), are freed
        as soon as the caller lets go of it. Kept alive until a garbage collection instead, a
        process group outlived ``destroy_process_group`` and was torn down as the process exited,
        after its peers had gone (a SIGABRT now and then)."""
        error, self.error = self.error, None
        self.__context__ = None  # ``error``, being handled when this was raised
        try:
            raise error from None
        finally:
            del error


class Group:
    """A process group or communicator as the recorder sees it.

    ``seq_source`` is c10d's ``_get_sequence_number_for_group``, where there is one: collective
    sequence numbers then equal c10d's even for collectives issued from C++ (DDP's reducer). Some
    backends (gloo) count point-to-point ops in that number too; ``p2p_in_source`` counts the p2p
    ops this process saw it absorb, so that the collective number stays equal across ranks and
    equal to the ``collective_seq_id`` of c10d's own flight recorder.
    """

    __slots__ = ("handle", "name", "desc", "ranks", "rank", "own_rank", "backend", "sid", "seq_source",
                 "p2p_in_source", "collective_seq", "p2p_seq", "_group_rank")

    def __init__(self, handle: Any, name: str, desc: str, ranks: list[int], rank: int, backend: str,
                 seq_source: Callable[[], int] | None = None):
        self.handle, self.name, self.desc, self.ranks, self.rank = handle, name, desc, ranks, rank
        self.backend, self.seq_source = backend, seq_source
        self.p2p_in_source = self.collective_seq = self.p2p_seq = 0
        self._group_rank = {g: i for i, g in enumerate(ranks)}
        self.own_rank = self._group_rank.get(rank, rank)
        """This process's rank within the group."""
        self.sid = ring().intern(json.dumps({"name": name, "desc": desc, "ranks": ranks, "rank": rank,
                                             "backend": backend}))

    def next_collective_seq(self) -> int:
        if self.seq_source is not None:
            return self.seq_source() + 1 - self.p2p_in_source
        self.collective_seq += 1
        return self.collective_seq

    def group_rank(self, global_rank: int | None) -> int | None:
        return None if global_rank is None else self._group_rank.get(global_rank, global_rank)


class InFlight(PreHookArgs):
    """One collective between ``begin()`` and completion; the pre-hook arguments are this object."""

    __slots__ = ("code", "flags", "group", "sid", "nbytes", "sig", "wire_peer", "t0", "source_seq", "work", "bucket",
                 "gpu")

    def issued(self, result: Any, from_work: bool = False) -> None:
        """The backend accepted the op. ``result`` is its work object when ``async_op`` is true, or
        when ``from_work``: the op completes when the work does even if it is synchronous (PyTorch's
        own post-hook fires when the op is queued)."""
        if self.source_seq is not None:
            self.group.p2p_in_source += self.group.seq_source() - self.source_seq
        follow = self.async_op or from_work
        if self.gpu is not None:  # on a CUDA device: completes when the GPU has finished it (hooks/cuda.py)
            future = None
            if follow and result is not None:
                self.work = result
                try:
                    future = result.get_future()
                except RuntimeError:  # no future to wait on: the end is marked where the op was queued
                    pass
            self.gpu_end(future)
            return
        if not follow or result is None:
            self.complete(OK, None, in_caller=True)
            return
        try:
            future = result.get_future()
        except RuntimeError:  # e.g. gloo point-to-point works have no future
            poller.watch(result, self)
            return
        self.work = result
        when_done(future, self._future_done)

    def failed(self, error: BaseException) -> None:
        """The op raised in the caller's thread: abort hooks run before the error propagates."""
        self.complete(TIMEOUT if _is_timeout(error) else ERROR, error)

    def complete(self, status: int, error: BaseException | None, in_caller: bool = False,
                 gpu_ns: tuple[int, int] | None = None) -> int:
        """Write END (after GPU_START, at the GPU's times ``gpu_ns``), run the abort and post-hooks;
        returns the completion time."""
        write = (_ring or ring()).write
        if gpu_ns is None and self.gpu is not None:  # completed without its GPU events (failed, or functional)
            cuda.tracker().release(self.gpu)
            self.gpu = None
        if gpu_ns is None:
            end = write(*self.end_fields(status))
        else:
            write(GPU_START, self.code, 0, self.sid, self.op_id, self.seq, self.nbytes, self.sig, self.wire_peer, 0, 0,
                  gpu_ns[0])
            end = write(*self.end_fields(status), 0, gpu_ns[1])
        if error is not None and abort_hooks.entries:
            abort_hooks.call(AbortHookArgs(self, error, STATUS[status]))
        if post_hooks.entries:
            try:
                post_hooks.call(PostHookArgs(self, self.work, STATUS[status], error, self.t0, end), in_caller)
            except Exception as raised:  # only hooks registered with propagate=True get here
                raise HookRaised(raised)
        return end

    def end_fields(self, status: int) -> tuple:
        """This op's END for ``Ring.write``, ``kind`` to ``aux`` (a DDP bucket's: the bytes on the wire)."""
        wire = 0 if self.bucket is None else min(self.bucket.wire_bytes, 0xFFFFFFFF)
        return END, self.code, status, self.sid, self.op_id, self.seq, self.nbytes, self.sig, self.wire_peer, wire

    def gpu_end(self, future: Any) -> None:
        """Complete this op on a CUDA device when the GPU has finished it (``future``: an async op's)."""
        cuda.tracker().end(self.gpu, future, self._gpu_done, lambda error: self.complete(_status(error), error))

    def _gpu_done(self, start_ns: int, end_ns: int) -> None:
        try:
            self.complete(OK, None, gpu_ns=(start_ns, end_ns))
        except Exception as error:  # the sidecar's thread: a hook's error stays there, counted
            internal_error("GPU completion", error)

    def _future_done(self, future: Any) -> None:
        try:
            future.value()
        except Exception as error:
            self.complete(TIMEOUT if _is_timeout(error) else ERROR, error)
        else:
            self.complete(OK, None)



def begin(op: OpName, group: Group, tensors: tuple, output_tensors: tuple, async_op: bool,
          root: int | None, peer: int | None, bucket: Any = None, inputs_finite: bool = False) -> InFlight:
    """Run the pre-hooks and write START for one op about to be issued; returns its record.
    ``bucket`` describes a DDP gradient bucket (``ddp.DdpBucket``); START's aux is its index + 1.
    ``inputs_finite``: the caller proved every input finite, and the input checks are left out."""
    call = InFlight.__new__(InFlight)
    call.name, call.op_id, call.pg, call.pg_name, call.rank = op, next(_op_ids), group.handle, group.name, group.rank
    call.group_rank = group.own_rank
    call.tensors, call.output_tensors, call.async_op, call.root, call.peer = tensors, output_tensors, async_op, root, peer
    call.group, call.sid, call.code, call.flags = group, group.sid, CODE[op], FLAG_ASYNC if async_op else 0
    call.work, call.bucket, call.gpu = None, bucket, None
    if bucket is not None and bucket.is_last:
        call.flags |= FLAG_LAST_BUCKET
    if op.is_p2p:
        group.p2p_seq += 1
        call.seq = group.p2p_seq
        call.source_seq = group.seq_source() if group.seq_source is not None else None
    else:
        call.seq = group.next_collective_seq()
        call.source_seq = None
    call.sig, call.nbytes = signature(tensors, output_tensors)
    target = peer if root is None else root
    call.wire_peer = -1 if target is None else target
    if pre_hooks.entries:
        try:
            pre_hooks.call(call, inputs_finite=inputs_finite)
        except Exception as error:  # only hooks registered with propagate=True get here
            _write_start(call)
            call.failed(error)
            raise HookRaised(error)
    _write_start(call)
    device = _cuda_device(tensors, output_tensors)
    if device is not None:
        call.gpu = cuda.tracker().start(device)
    return call


def start(op: OpName, group: Group, tensors: tuple, output_tensors: tuple, async_op: bool,
          root: int | None, peer: int | None, bucket: Any = None, inputs_finite: bool = False) -> InFlight | None:
    """``begin()`` as a source calls it: a propagating pre-hook's error is raised to the caller as it
    is; a failure of commlens itself is counted and gives None (the op then goes on unrecorded)."""
    try:
        return begin(op, group, tensors, output_tensors, async_op, root, peer, bucket, inputs_finite)
    except HookRaised as raised:
        raised.reraise()
    except Exception as error:
        if all_tensors(tensors, output_tensors):  # else the caller's mistake, which torch reports itself
            internal_error("begin", error)
        return None


def settle(step: Callable[[Any], None], result: Any) -> None:
    """``step(result)`` once the op is issued (``InFlight.issued`` or a source's own): as ``start()``
    does, a propagating post-hook's error reaches the caller, a failure of commlens is counted."""
    try:
        step(result)
    except HookRaised as raised:
        raised.reraise()
    except Exception as error:
        internal_error("issued", error)


def aborted(group_name: str) -> None:
    """PyTorch is aborting the process group ``group_name`` (its own abort hook): the abort hooks run."""
    if abort_hooks.entries:
        abort_hooks.call(AbortHookArgs(None, RuntimeError(f"process group {group_name!r} is being aborted"), "error"))


UNPROVEN = object()
"""What ``run_unhooked`` returns when the NaN check's scan did not prove the inputs finite: nothing
was recorded or issued, and the caller takes the hooked path, where the check's hook decides."""


def run_unhooked(code: int, group: Group, tensors: tuple, output_tensors: tuple, wire_peer: int,
                 call: Callable, args: tuple, kwargs: dict, check_inputs: bool = False) -> Any:
    """``call(*args, **kwargs)``, a synchronous collective, recorded as START and END with nothing
    else: the path taken while no pre- or post-hook is registered (``check_inputs``: the NaN
    check's only, which the scan of ``finite`` stands in for, or ``UNPROVEN`` is returned). Allocates
    no per-op object unless it fails (the abort hooks' arguments)."""
    try:
        # signature(), the scan and next_collective_seq(), with their common cases inlined: this runs
        # per op (a call costs ~0.4 µs in a loop of collectives), and reads an in-place tensor's shape
        # and dtype once for its signature and its scan
        if len(tensors) == 1 and output_tensors is tensors:
            t = tensors[0]
            key = (t.shape, t.dtype)
            sig, nbytes, scan = in_place.get(key) or describe_in_place(t, key)
            if check_inputs and (scan is None or finite.scanned(t, scan) is not True):
                return UNPROVEN
        else:
            if check_inputs and not finite.inputs_finite(tensors):
                return UNPROVEN
            sig, nbytes = signature(tensors, output_tensors)
        op_id = next(_op_ids)
        source = group.seq_source
        seq = source() + 1 - group.p2p_in_source if source is not None else group.next_collective_seq()
        write, sid = (_ring or ring()).write, group.sid
        write(START, code, 0, sid, op_id, seq, nbytes, sig, wire_peer, 0, 0 if where is None else where())
        device = _cuda_device(tensors, output_tensors)
        pair = None if device is None else cuda.tracker().start(device)
    except Exception as error:
        if all_tensors(tensors, output_tensors):  # else the caller's mistake, which torch reports itself
            internal_error("START", error)
        return call(*args, **kwargs)
    if pair is not None:  # completes when the GPU has finished it (hooks/cuda.py)
        try:
            result = call(*args, **kwargs)
        except BaseException as error:
            cuda.tracker().release(pair)
            failed_unhooked(code, group, op_id, seq, nbytes, sig, wire_peer, tensors, output_tensors, error)
            raise
        cuda.tracker().end(pair, None, lambda start_ns, end_ns: cuda.write_completion(
            code, OK, sid, op_id, seq, nbytes, sig, wire_peer, 0, start_ns, end_ns), None)
        return result
    try:
        result = call(*args, **kwargs)
    except BaseException as error:
        failed_unhooked(code, group, op_id, seq, nbytes, sig, wire_peer, tensors, output_tensors, error)
        raise
    write(END, code, OK, sid, op_id, seq, nbytes, sig, wire_peer, 0)
    return result


def failed_unhooked(code: int, group: Group, op_id: int, seq: int, nbytes: int, sig: int, wire_peer: int,
                     tensors: tuple, output_tensors: tuple, error: BaseException) -> None:
    """END of a collective that raised on the unhooked path, then the abort hooks, with the
    arguments the hooked path gives them: abort hooks do not take a collective off this path."""
    try:
        status = _status(error)
        (_ring or ring()).write(END, code, status, group.sid, op_id, seq, nbytes, sig, wire_peer, 0)
        if abort_hooks.entries:
            call = PreHookArgs(OPS[code], op_id, group.handle, group.name, seq, tensors, output_tensors, False,
                               None if wire_peer < 0 else wire_peer, None, group.rank, group.own_rank)
            abort_hooks.call(AbortHookArgs(call, error, STATUS[status]))
    except Exception as failed:  # the collective's own error is what reaches the caller
        internal_error("END", failed)


_warned = False


def all_tensors(*groups: tuple) -> bool:
    """Every argument in ``groups`` is a tensor: a failure to record the op is then commlens' own."""
    import torch

    return all(isinstance(t, torch.Tensor) for group in groups for t in group)


def count_error(kind: str) -> None:
    """Count lost telemetry in the ring's header (``ERRORS``); nowhere if there is no ring (it could
    not be created: that error is the one the caller is reporting)."""
    if _ring is not None:
        _ring.count_error(kind)


def internal_error(where: str, error: Exception) -> None:
    """Count a failure of commlens itself (in the ring's header); warn about the first. The
    collective goes on unrecorded."""
    global _warned
    count_error("recorder")
    if not _warned:
        _warned = True
        warnings.warn(f"commlens could not record a collective ({where}: {error!r}); the collective "
                      "went on unrecorded, and later such errors are only counted", RuntimeWarning, stacklevel=3)


def record_nan(call: InFlight, index: int, flags: int, count: int) -> None:
    """Write a NAN record: tensor ``index`` of ``call`` held ``count`` non-finite elements."""
    ring().write(NAN, call.code, flags, call.sid, call.op_id, call.seq, count, call.sig, call.wire_peer, index)


def _write_start(call: InFlight) -> None:
    call.t0 = (_ring or ring()).write(START, call.code, call.flags, call.sid, call.op_id, call.seq, call.nbytes,
                                      call.sig, call.wire_peer, 0 if call.bucket is None else call.bucket.index + 1,
                                      0 if where is None else where())


def _cuda_device(tensors: tuple, output_tensors: tuple) -> Any:
    """The CUDA device of an op's tensors, or None (CPU tensors keep the CPU's timing)."""
    for group in (tensors, output_tensors):
        if group:
            t = group[0]
            return t.device if t.is_cuda else None
    return None


def _status(error: BaseException | None) -> int:
    return OK if error is None else (TIMEOUT if _is_timeout(error) else ERROR)


def _is_timeout(error: BaseException) -> bool:
    return "timed out" in str(error).lower() or "timeout" in type(error).__name__.lower()


_DTYPE_NAMES: dict[Any, str] = {}
_signatures: dict[tuple, tuple[int, int]] = {}
"""(shapes and dtypes of the inputs, of the outputs) -> signature and payload bytes."""
in_place: dict[tuple, tuple[int, int, tuple[int, int] | None]] = {}
"""(shape, dtype) of an op's one tensor, input and output at once -> its signature, payload bytes and
``finite.scan_of``: one entry per shape for the signature and the NaN check's scan."""


def dtype_name(dtype: Any) -> str:
    """c10's name for a dtype ("Float", "BFloat16"), as PyTorch's flight recorder writes it."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        import torch

        name = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
                torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
                torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool", torch.complex64: "ComplexFloat",
                torch.complex128: "ComplexDouble"}.get(dtype, str(dtype).removeprefix("torch."))
        _DTYPE_NAMES[dtype] = name
    return name


def _meta(tensors: tuple) -> tuple:
    return tuple([(t.shape, t.dtype) for t in tensors])


def signature(tensors: tuple, output_tensors: tuple) -> tuple[int, int]:
    """(string id of the shapes and dtypes, payload bytes) for an op's inputs and outputs.

    Payload bytes are the larger of the input and output totals: the nccl-tests "size" of the op.
    """
    if len(tensors) == 1 and output_tensors is tensors:  # the common in-place case, keyed cheaply
        t = tensors[0]
        key = (t.shape, t.dtype)
        return (in_place.get(key) or describe_in_place(t, key))[:2]
    key = (_meta(tensors), _meta(output_tensors))
    found = _signatures.get(key)
    if found is None:
        found = _signatures.setdefault(key, _new_signature(tensors, output_tensors))
    return found


def _new_signature(tensors: tuple, outs: tuple) -> tuple[int, int]:
    in_bytes = sum(t.numel() * t.element_size() for t in tensors)
    out_bytes = sum(t.numel() * t.element_size() for t in outs)
    text = json.dumps([[list(t.shape) for t in tensors], [dtype_name(t.dtype) for t in tensors],
                       [list(t.shape) for t in outs], [dtype_name(t.dtype) for t in outs]])
    return ring().intern(text), max(in_bytes, out_bytes)


def describe_in_place(t: Any, key: tuple) -> tuple[int, int, tuple[int, int] | None]:
    tensors = (t,)
    return in_place.setdefault(key, (*_new_signature(tensors, tensors), finite.scan_of(t.dtype, t.numel())))


class CompletionPoller:
    """Completes async works that have no future (gloo point-to-point, gloo reduce_scatter), so the
    post-hook fires at completion without anyone blocking on ``wait()``:

    * ``wait()`` returning completes the op at once (``waited`` wraps ``Work.wait``);
    * a daemon thread polls ``is_completed()``, backing off from 0.5 ms to 50 ms while nothing
      completes, and sleeping while nothing is watched — it never spins on a work;
    * a work the caller drops without waiting, and that never said it completed (gloo's
      reduce_scatter reports ``is_completed() == False`` for good), cannot be judged: it is completed
      when dropped and counted (the ring's ``work_unjudged`` error), never left to look like a hang.

    Works are held by weak reference, so watching one never keeps it alive.
    """

    FIRST_PERIOD_S, LAST_PERIOD_S = 0.0005, 0.05

    def __init__(self) -> None:
        self._pending: dict[int, tuple[weakref.ref, InFlight]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.RLock()  # a weak reference's callback may run while it is held

    def watch(self, work: Any, call: InFlight) -> None:
        key = id(work)
        with self._lock:
            self._pending[key] = (weakref.ref(work, lambda _, key=key: self._dropped(key)), call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="commlens-completion", daemon=True)
                self._thread.start()
        self._wake.set()

    def _take(self, key: int) -> InFlight | None:
        with self._lock:
            entry = self._pending.pop(key, None)
        return None if entry is None else entry[1]

    def waited(self, work: Any, error: BaseException | None) -> None:
        """``work.wait()`` returned (or raised ``error``): its op has completed."""
        call = self._take(id(work))
        if call is not None:
            call.work = work
            call.complete(_status(error), error)
            call.work = None

    def _dropped(self, key: int) -> None:
        call = self._take(key)
        if call is not None:
            count_error("work_unjudged")
            call.complete(OK, None)

    def _run(self) -> None:
        period = self.FIRST_PERIOD_S
        while True:
            if not self._pending:
                self._wake.wait()
                period = self.FIRST_PERIOD_S
            self._wake.clear()
            period = self.FIRST_PERIOD_S if self._poll() else min(period * 2, self.LAST_PERIOD_S)
            if self._pending:
                self._wake.wait(period)

    def _poll(self) -> bool:
        """Complete the watched works that say they completed; True if any did. Holds no work after."""
        with self._lock:
            pending = list(self._pending.items())
        completed = False
        for key, (ref, _) in pending:
            work = ref()
            if work is None:
                continue
            try:
                if not work.is_completed():
                    continue
                error = None if work.is_success() else (work.exception() or RuntimeError("work failed"))
            except Exception as raised:  # a work that cannot say: it failed, as far as anyone can tell
                error = raised
            completed = True
            call = self._take(key)
            if call is not None:
                call.work = work
                call.complete(_status(error), error)
                call.work = None
        return completed


poller = CompletionPoller()


def waited(original: Callable) -> Callable:
    """``Work.wait`` that tells the poller when a watched work has been waited for."""

    def wait(work, *args, **kwargs):
        if not poller._pending:
            return original(work, *args, **kwargs)
        try:
            result = original(work, *args, **kwargs)
        except BaseException as error:
            poller.waited(work, error)
            raise
        poller.waited(work, None)
        return result

    wait.__wrapped__ = original
    return wait
