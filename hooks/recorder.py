"""One collective from its pre-hooks to its post-hooks: ``begin()`` and ``InFlight``, and the
unhooked path (``run_unhooked``) taken while no hook needs to see it.

``begin()`` runs the pre-hooks, writes START and returns the op's ``InFlight``; the source then calls
``issued()`` with what the backend returned, or ``failed()`` with its exception (``issuing.py`` owns
that order for every source). Completion writes END and runs the post-hooks: at once for a
synchronous op, from the work's future or the completion poller for an async one — never by
blocking the caller.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn

from commlens.ring.layout import FLAG_ASYNC, FLAG_LAST_BUCKET, OK, STATUS, start_aux
from commlens.ring.ops import CODE, OPS, OpName

from . import cuda, fingerprints, finite, process_ring, record, signatures
from ._state import state
from .futures import when_done
from .ops import AbortHookArgs, PostHookArgs, PreHookArgs
from .poller import poller
from .record import Group, new_op_id, status_of
from .registry import abort_hooks, post_hooks, pre_hooks


class HookRaised(Exception):
    """A propagating pre- or post-hook raised ``error``; the source re-raises it to the caller."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    def reraise(self) -> NoReturn:
        """Raise ``error`` as it is, leaving no reference cycle between the two exceptions, so that
        its frames' tensors and process group are freed with it (docs/hooks.md says why)."""
        error, self.error = self.error, None
        self.__context__ = None  # ``error``, being handled when this was raised
        try:
            raise error from None
        finally:
            del error


class InFlight(PreHookArgs):
    """One collective between ``begin()`` and completion; the pre-hook arguments are this object."""

    __slots__ = ("code", "flags", "group", "sid", "nbytes", "sig", "wire_peer", "t0", "source_seq", "work", "bucket",
                 "gpu")

    def issued(self, result: Any, from_work: bool = False) -> None:
        """The backend accepted the op. ``result`` is its work object when ``async_op`` is true, or
        when ``from_work``: the op completes when the work does even if it is synchronous (PyTorch's
        own post-hook fires when the op is queued)."""
        if self.name.is_p2p:
            self.group.p2p_issued(self.source_seq)
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
        self.complete(status_of(error), error)

    def complete(self, status: int, error: BaseException | None, in_caller: bool = False,
                 gpu_ns: tuple[int, int] | None = None) -> int:
        """Write END (after GPU_START, at the GPU's times ``gpu_ns``), run the abort and post-hooks;
        returns the completion time."""
        if gpu_ns is None and self.gpu is not None:  # completed without its GPU events (failed, or functional)
            cuda.tracker().release(self.gpu)
            self.gpu = None
        fields = (record.writer(), self.code, self.sid, self.op_id, self.seq, self.nbytes, self.sig, self.wire_peer,
                  status, self._wire_bytes())
        if gpu_ns is not None:
            end = record.end_on_gpu(*fields, *gpu_ns)
        elif status == OK and (in_caller or self.bucket is not None) and fingerprints.due(self.code, self.seq):
            # FINGERPRINT, then END at its own time. An async op's future wakes its waiters before its callbacks
            # run: the caller may write the result while it is read here, so only a result the caller has not
            # yet got is read (a sync op's, a waited one's, a DDP bucket's, whose future DDP gets follows this)
            end = fingerprints.write(fields[0], self.code, self.sid, self.op_id, self.seq, self.sig, self.output_tensors)
            record.end(*fields, t_ns=end)
        else:
            end = record.end(*fields)
        if error is not None and abort_hooks.entries:
            abort_hooks.call(AbortHookArgs(self, error, STATUS[status]))
        if post_hooks.entries:
            try:
                post_hooks.call(PostHookArgs(self, self.work, STATUS[status], error, self.t0, end), in_caller)
            except Exception as raised:  # only hooks registered with propagate=True get here
                raise HookRaised(raised)
        return end

    def end_args(self) -> tuple[int, ...]:
        """This op's END (status ok) as ``Ring.write``'s arguments, for a writer in C++; ``aux``: the
        bucket's bytes on the wire."""
        return record.end_args(self.code, self.sid, self.op_id, self.seq, self.nbytes, self.sig, self.wire_peer, OK,
                               self._wire_bytes())

    def fingerprint_args(self) -> tuple[int, ...]:
        """FINGERPRINT's arguments to ``Ring.write`` but its value (0), for a writer in C++ (``_ddp_hook.cpp``)."""
        return record.fingerprint_args(self.code, self.sid, self.op_id, self.seq, self.sig, state.fingerprint_every)

    def nan_args(self, index: int, flags: int) -> tuple[int, ...]:
        """NAN's arguments to ``Ring.write`` for tensor ``index`` of this op (count 0: not counted), for a
        writer in C++ (the GPU's poll, which adds the finding's bit to ``flags``)."""
        return record.nan_args(self.code, self.sid, self.op_id, self.seq, self.sig, self.wire_peer, index, flags, 0)

    def _wire_bytes(self) -> int:
        """END's aux: a DDP bucket's bytes on the wire (0 for any other op)."""
        return 0 if self.bucket is None else min(self.bucket.wire_bytes, 0xFFFFFFFF)

    def gpu_end(self, future: Any) -> None:
        """Complete this op on a CUDA device when the GPU has finished it (``future``: an async op's)."""
        done = self._gpu_done if post_hooks.entries else (record.producer(), self.end_args())  # no Python at the end
        cuda.tracker().end(self.gpu, future, done, self._gpu_failed)

    def _gpu_failed(self, error: BaseException) -> None:
        self.gpu = None  # the tracker gave its events back
        self.complete(status_of(error), error)

    def _gpu_done(self, start_ns: int, end_ns: int) -> None:
        try:
            self.complete(OK, None, gpu_ns=(start_ns, end_ns))
        except Exception as error:  # the sidecar's thread: a hook's error stays there, counted
            process_ring.internal_error("GPU completion", error)

    def _future_done(self, future: Any) -> None:
        try:
            future.value()
        except Exception as error:
            self.complete(status_of(error), error)
        else:
            self.complete(OK, None)

    def nan(self, index: int, flags: int, count: int) -> None:
        """Write a NAN record: tensor ``index`` of this op held ``count`` non-finite elements."""
        record.nan(record.writer(), self.code, self.sid, self.op_id, self.seq, self.sig, self.wire_peer, index, flags,
                   count)


def begin(op: OpName, group: Group, tensors: tuple, output_tensors: tuple, async_op: bool,
          root: int | None, peer: int | None, bucket: Any = None, inputs_finite: bool = False) -> InFlight:
    """Run the pre-hooks and write START for one op about to be issued; returns its record.
    ``bucket`` describes a DDP gradient bucket (``ddp.DdpBucket``); START's aux holds its index and scale.
    ``inputs_finite``: the caller proved every input finite, and the input checks are left out.
    A propagating pre-hook's error is raised as ``HookRaised``, after the op's START and END."""
    call = InFlight.__new__(InFlight)
    call.name, call.op_id, call.pg, call.pg_name, call.rank = op, new_op_id(), group.handle, group.name, group.rank
    call.group_rank = group.own_rank
    call.tensors, call.output_tensors, call.async_op, call.root, call.peer = tensors, output_tensors, async_op, root, peer
    call.group, call.sid, call.code, call.flags = group, group.sid, CODE[op], FLAG_ASYNC if async_op else 0
    call.work, call.bucket, call.gpu = None, bucket, None
    if bucket is not None and bucket.is_last:
        call.flags |= FLAG_LAST_BUCKET
    if op.is_p2p:
        call.seq, call.source_seq = group.next_p2p_seq()
    else:
        call.seq, call.source_seq = group.next_collective_seq(), None
    call.sig, call.nbytes = signatures.signature(tensors, output_tensors)
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


def _write_start(call: InFlight) -> None:
    bucket = call.bucket
    call.t0 = record.start(record.writer(), call.code, call.sid, call.op_id, call.seq, call.nbytes, call.sig,
                           call.wire_peer, call.flags, 0 if bucket is None else start_aux(bucket.index, bucket.exponent))


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
        # signatures.signature() and the scan, with the common case inlined: an in-place tensor's
        # shape and dtype are read once for its signature and its scan
        if len(tensors) == 1 and output_tensors is tensors:
            t = tensors[0]
            key = (t.shape, t.dtype)
            sig, nbytes, scan = signatures.in_place.get(key) or signatures.describe_in_place(t, key)
            if check_inputs and (scan is None or finite.scanned(t, scan) is not True):
                return UNPROVEN
        else:
            if check_inputs and not finite.inputs_finite(tensors):
                return UNPROVEN
            sig, nbytes = signatures.signature(tensors, output_tensors)
        op_id, seq, sid = new_op_id(), group.next_collective_seq(), group.sid
        write = record.writer()
        record.start(write, code, sid, op_id, seq, nbytes, sig, wire_peer)
        device = _cuda_device(tensors, output_tensors)
        pair = None if device is None else cuda.tracker().start(device)
    except Exception as error:
        if all_tensors(tensors, output_tensors):  # else the caller's mistake, which torch reports itself
            process_ring.internal_error("START", error)
        return call(*args, **kwargs)
    try:
        result = call(*args, **kwargs)
    except BaseException as error:
        if pair is not None:
            cuda.tracker().release(pair)
        failed_unhooked(code, group, op_id, seq, nbytes, sig, wire_peer, tensors, output_tensors, error)
        raise
    if pair is not None:  # completes when the GPU has finished it (hooks/cuda.py)
        end = record.end_args(code, sid, op_id, seq, nbytes, sig, wire_peer)
        cuda.tracker().end(pair, None, (record.producer(), end), None)
    elif fingerprints.due(code, seq):  # FINGERPRINT, then END at its own time
        end = fingerprints.write(write, code, sid, op_id, seq, sig, output_tensors)
        record.end(write, code, sid, op_id, seq, nbytes, sig, wire_peer, t_ns=end)
    else:
        record.end(write, code, sid, op_id, seq, nbytes, sig, wire_peer)
    return result


def failed_unhooked(code: int, group: Group, op_id: int, seq: int, nbytes: int, sig: int, wire_peer: int,
                    tensors: tuple, output_tensors: tuple, error: BaseException) -> None:
    """END of a collective that raised on the unhooked path, then the abort hooks, with the
    arguments the hooked path gives them: abort hooks do not take a collective off this path."""
    try:
        status = status_of(error)
        record.end(record.writer(), code, group.sid, op_id, seq, nbytes, sig, wire_peer, status)
        if abort_hooks.entries:
            call = PreHookArgs(OPS[code], op_id, group.handle, group.name, seq, tensors, output_tensors, False,
                               None if wire_peer < 0 else wire_peer, None, group.rank, group.own_rank)
            abort_hooks.call(AbortHookArgs(call, error, STATUS[status]))
    except Exception as failed:  # the collective's own error is what reaches the caller
        process_ring.internal_error("END", failed)


def all_tensors(*groups: tuple) -> bool:
    """Every argument in ``groups`` is a tensor: a failure to record the op is then commlens' own."""
    import torch

    return all(isinstance(t, torch.Tensor) for group in groups for t in group)


def _cuda_device(tensors: tuple, output_tensors: tuple) -> Any:
    """The CUDA device of an op's tensors, or None (CPU tensors keep the CPU's timing)."""
    for group in (tensors, output_tensors):
        if group:
            t = group[0]
            return t.device if t.is_cuda else None
    return None
