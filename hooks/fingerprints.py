"""Which collectives' results are fingerprinted, and the fingerprint: a group's collectives whose sequence
number is a multiple of N (``state.fingerprint_every``: the same collectives on every rank) of an op whose
members all end holding the same bytes (all_reduce, broadcast, all_gather), on the CPU. The sidecar
compares a group's fingerprints at one sequence number: a rank whose result differs got a corrupted
transfer, or corrupted it in place (docs/verdicts.md).

Example::

    if due(code, seq):
        ended = write(write_fn, code, sid, op_id, seq, sig, output_tensors)   # FINGERPRINT, before END
"""

from __future__ import annotations

import time
from typing import Callable

from commlens.ring.ops import CODE, OpName

from . import _fingerprint, process_ring, record
from ._state import state

REPLICA_CODES = frozenset(CODE[op] for op in (OpName.all_reduce, OpName.broadcast, OpName.all_gather,
                                              OpName.all_gather_into_tensor))
"""The ops after which every member of the group holds the same output."""
_MASK = (1 << 48) - 1


def due(code: int, seq: int) -> bool:
    """Whether collective ``seq`` of its group, of op ``code``, is one whose result is fingerprinted."""
    every = state.fingerprint_every
    return every > 0 and seq % every == 0 and code in REPLICA_CODES


def of(tensors: tuple) -> int | None:
    """The fingerprint of ``tensors`` taken together (48 bits: a Prometheus sample holds it exactly);
    None when one of them cannot be read here (not a contiguous CPU tensor)."""
    found = 0
    for t in tensors:
        one = _fingerprint.fingerprint(t)
        if one is None:
            return None
        found = (found * 0x9E3779B1 + one) & _MASK
    return found


def write(write_fn: Callable[..., int], code: int, sid: int, op_id: int, seq: int, sig: int, outputs: tuple) -> int:
    """FINGERPRINT of ``outputs``, where they can be read here (else counted: ``fingerprint_unread``); a
    failure is counted, never raised. Returns the time it was called, for the op's END (written next:
    the hash is not the collective's time)."""
    called = time.monotonic_ns()
    try:
        value = of(outputs)
        if value is None:
            process_ring.count_error("fingerprint_unread")
        else:
            record.fingerprint(write_fn, code, sid, op_id, seq, sig, value, state.fingerprint_every)
    except Exception as error:  # noqa: BLE001 — telemetry never fails the collective
        process_ring.internal_error("FINGERPRINT", error)
    return called
