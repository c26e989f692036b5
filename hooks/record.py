"""The record: how one collective is written into the ring, and each group's numbers.

The one module that writes records (``commlens.ring.layout`` holds their layout and codes; ``Ring.write``
is positional and C). Every record of one op carries the op's fields, always in this order:

* ``op``: its code (``commlens.ring.ops.CODE``), ``pg``: the string id of its group (``encode_group``),
* ``op_id``: unique in the process, ``seq``: its number in the group (``Group``: c10d's formula),
* ``nbytes``: its payload, ``sig``: the string id of its tensors' shapes and dtypes
  (``encode_signature``), ``peer``: its root or peer as a group rank (-1: none).

The strings are JSON (``commlens.ring.codec``, where every reader decodes them).

Example::

    write = ring.write
    t0 = record.start(write, op, pg, op_id, seq, nbytes, sig, -1)
    record.end(write, op, pg, op_id, seq, nbytes, sig, -1, status=record.status_of(error))
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from commlens.ring.codec import encode_group
from commlens.ring.layout import (END, ERROR, FINGERPRINT, GPU_START, LOSS_SCALE, LOSS_SCALE_EVENTS, NAN, OK, REASONS,
                                   SNAPSHOT, START, TIMEOUT)

from . import process_ring
from ._state import state

Write = Callable[..., int]
"""``Ring.write``: (kind, op, flags, pg, op_id, seq, nbytes, sig, peer, aux, where=0, t_ns=now) -> t_ns."""

new_op_id: Callable[[], int] = itertools.count(1).__next__
"""A fresh op id: larger than every id issued so far, smaller than every later one (C, no frame)."""


def writer() -> Write:
    """This process's ring's ``write``."""
    return (state.ring or process_ring.ring()).write


def producer() -> Any:
    """This process's ring's producer, for writers in C and C++ (``_producer.write_record``)."""
    return (state.ring or process_ring.ring()).producer


def start(write: Write, op: int, pg: int, op_id: int, seq: int, nbytes: int, sig: int, peer: int,
          flags: int = 0, aux: int = 0, t_ns: int | None = None) -> int:
    """START: the op is about to be issued (``flags``: ``FLAG_*``; ``aux``: a DDP bucket's
    ``layout.start_aux``); returns its time."""
    where = state.where  # set by ``attribution.enable()``: the (module string id << 8) | phase of an op issued now
    at = 0 if where is None else where()
    if t_ns is None:
        return write(START, op, flags, pg, op_id, seq, nbytes, sig, peer, aux, at)
    return write(START, op, flags, pg, op_id, seq, nbytes, sig, peer, aux, at, t_ns)


def end(write: Write, op: int, pg: int, op_id: int, seq: int, nbytes: int, sig: int, peer: int,
        status: int = OK, wire_bytes: int = 0, t_ns: int | None = None) -> int:
    """END: the op completed with ``status`` (``wire_bytes``: what a DDP bucket's hook sent); returns its time."""
    if t_ns is None:
        return write(END, op, status, pg, op_id, seq, nbytes, sig, peer, wire_bytes)
    return write(END, op, status, pg, op_id, seq, nbytes, sig, peer, wire_bytes, 0, t_ns)


def end_args(op: int, pg: int, op_id: int, seq: int, nbytes: int, sig: int, peer: int, status: int = OK,
             wire_bytes: int = 0) -> tuple[int, ...]:
    """END's arguments to ``Ring.write`` (``where`` included), for a writer in C++ (``_ddp_hook.cpp``)."""
    return END, op, status, pg, op_id, seq, nbytes, sig, peer, wire_bytes, 0


def end_on_gpu(write: Write, op: int, pg: int, op_id: int, seq: int, nbytes: int, sig: int, peer: int,
               status: int, wire_bytes: int, gpu_start_ns: int, gpu_end_ns: int) -> int:
    """GPU_START and END: the op ran on the GPU from ``gpu_start_ns`` to ``gpu_end_ns`` (monotonic clock)."""
    write(GPU_START, op, 0, pg, op_id, seq, nbytes, sig, peer, 0, 0, gpu_start_ns)
    return write(END, op, status, pg, op_id, seq, nbytes, sig, peer, wire_bytes, 0, gpu_end_ns)


def nan(write: Write, op: int, pg: int, op_id: int, seq: int, sig: int, peer: int, index: int, flags: int,
        count: int) -> int:
    """NAN: tensor ``index`` of the op held ``count`` non-finite elements (``flags``: ``NAN_*``)."""
    return write(*nan_args(op, pg, op_id, seq, sig, peer, index, flags, count))


def nan_args(op: int, pg: int, op_id: int, seq: int, sig: int, peer: int, index: int, flags: int,
             count: int) -> tuple[int, ...]:
    """NAN's arguments to ``Ring.write`` (``where`` included), for a writer in C++ (``_gpu.cpp``)."""
    return NAN, op, flags, pg, op_id, seq, count, sig, peer, index, 0


def fingerprint(write: Write, op: int, pg: int, op_id: int, seq: int, sig: int, value: int, every: int) -> int:
    """FINGERPRINT: the op's result, which every member of its group holds alike, as ``value``
    (``fingerprints.of``); one of every ``every`` collectives of the group."""
    return write(*fingerprint_args(op, pg, op_id, seq, sig, every, value))


def fingerprint_args(op: int, pg: int, op_id: int, seq: int, sig: int, every: int, value: int = 0) -> tuple[int, ...]:
    """FINGERPRINT's arguments to ``Ring.write`` (``where`` included), for a writer in C++ (``_ddp_hook.cpp``),
    which puts the value in ``nbytes`` (index 6)."""
    return FINGERPRINT, op, 0, pg, op_id, seq, value, sig, -1, every, 0


def snapshot(write: Write, reason: str) -> int:
    """SNAPSHOT: the writer asks its reader for a flight-recorder dump, for ``reason`` (``REASONS``)."""
    return write(SNAPSHOT, 0, REASONS.index(reason), 0, 0, 0, 0, 0, -1, 0)


def loss_scale(write: Write, event: str) -> int:
    """LOSS_SCALE: a loss scaler's ``event`` (``LOSS_SCALE_EVENTS``)."""
    return write(LOSS_SCALE, 0, LOSS_SCALE_EVENTS.index(event), 0, 0, 0, 0, 0, -1, 0)


def status_of(error: BaseException | None) -> int:
    """The END status of an op that raised ``error`` (None: it did not)."""
    if error is None:
        return OK
    return TIMEOUT if "timed out" in str(error).lower() or "timeout" in type(error).__name__.lower() else ERROR


class Group:
    """A process group or communicator as the records see it: its string id, and its ops' numbers.

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
        self.sid = process_ring.ring().intern(encode_group(name, desc, ranks, rank, backend))

    def next_collective_seq(self) -> int:
        """The number of the collective about to be issued (c10d's, where the group has a ``seq_source``)."""
        if self.seq_source is not None:
            return self.seq_source() + 1 - self.p2p_in_source
        self.collective_seq += 1
        return self.collective_seq

    def next_p2p_seq(self) -> tuple[int, int | None]:
        """The number of the point-to-point op about to be issued, and ``seq_source`` now (or None):
        ``p2p_issued`` takes it back once the op is issued."""
        self.p2p_seq += 1
        return self.p2p_seq, None if self.seq_source is None else self.seq_source()

    def p2p_issued(self, source_before: int | None) -> None:
        """A point-to-point op was issued: what it added to ``seq_source`` was not a collective."""
        if source_before is not None:
            self.p2p_in_source += self.seq_source() - source_before

    def group_rank(self, global_rank: int | None) -> int | None:
        return None if global_rank is None else self._group_rank.get(global_rank, global_rank)
