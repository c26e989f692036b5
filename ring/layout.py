"""The ring's contract, for writers and readers alike: the record's layout and its fields' codes (kinds,
flags, statuses, phases), what the header holds and where. ``_record.h`` is the same record for C;
``_producer.c`` and ``_fold.c`` check its size against ``RECORD``'s. Imports nothing.

Example::

    fields = RECORD.unpack(data)           # 72 bytes, as a slot holds them
    record = Record._make(fields)
    record.kind == START, STATUS[record.flags] if record.kind == END else None
"""

from __future__ import annotations

import struct
from typing import NamedTuple

START, END, NAN, GPU_START, SNAPSHOT, LOSS_SCALE, FINGERPRINT = 1, 2, 3, 4, 5, 6, 7
"""Record kinds: a collective was issued, finished, had a non-finite tensor, started on the GPU; the
writer asks its reader for a flight-recorder snapshot (``flags``: the reason's index in ``REASONS``);
a loss scaler began or ended a step (``flags``: the index in ``LOSS_SCALE_EVENTS``); a collective's
result, which every member of its group holds alike, as one number (in ``nbytes``: ``_fingerprint.c``)."""
REASONS = ("abort", "hang", "signal", "exception", "peer", "exit")
"""Why a snapshot was written (each one's meaning: ``commlens_abort_snapshots_total`` in docs/metrics.md)."""
ERRORS = ("hook", "recorder", "string_dropped", "work_unjudged", "gpu_pool_exhausted", "gpu_captured",
          "fingerprint_unread")
"""What the writer lost, counted in the header (``commlens_telemetry_errors_total`` in docs/metrics.md)."""
LOSS_SCALE_EVENTS = ("scaled", "applied", "skipped", "made")
"""A loss scaler (``torch.amp.GradScaler``) scaled a loss: the step's gradients follow; it ended the
step and applied it; it skipped it, the gradients holding Inf or NaN; it was made, enabled: its first
step begins (hooks/loss_scale.py)."""
NAN_OUTPUT, NAN_HAS_NAN, NAN_HAS_INF = 1, 2, 4
"""Bits of a NAN record's ``flags``: the tensor was an output; it held NaN; it held Inf."""
FLAG_ASYNC, FLAG_LAST_BUCKET = 1, 2
"""Bits of a START record's ``flags``: the op is async; it is a DDP model's last gradient bucket."""
BUCKET_BITS, EXPONENT_OFFSET = 16, 2048
"""A START record's ``aux``: a DDP bucket's index + 1 in its low ``BUCKET_BITS`` bits (0: no bucket); above
them, the largest binary exponent among the bucket's values as its pass over them found it, + ``EXPONENT_OFFSET``
(0: not known; ``start_aux``)."""
OK, ERROR, TIMEOUT, NOT_ISSUED = 0, 1, 2, 3
STATUS = ("ok", "error", "timeout", "not_issued")
"""An END record's ``flags``: the op's status, by index. ``not_issued``: a DDP bucket whose communication
hook issued no collective (``noop_hook``); it is no collective, and readers of the ring drop it."""
PHASES = ("", "other", "forward", "backward", "optimizer")
"""A record's ``phase``: where in the training step the op was issued (module attribution)."""

HEADER = struct.Struct("<8sIIIII")
"""The header's first fields: magic, version, slots, record size, string bytes, string alignment;
the rest at the offsets below."""
HEADER_SIZE = 128
INFO_OFFSET = 28  # the string id of the writer's description (uint32)
CLOCK_OFFSET = 32  # wall clock - monotonic clock of the writer, ns (int64)
PID_OFFSET = 40  # the writer's pid (uint32)
CLOSED_OFFSET = 44  # 1 once the writer closed the ring (uint32)
STRING_CLAIM_OFFSET = 48  # bytes of the string arena claimed so far (uint64)
CLAIM_OFFSET = 56  # the producers' next index (uint64)
CURSOR_OFFSET = 64  # the reader's next index (uint64)
ERRORS_OFFSET = 72  # one uint64 per ERRORS kind, to HEADER_SIZE
MAGIC = b"CMLNSRNG"
VERSION = 5
RECORD = struct.Struct("<QBBBBIQQQQIiIIQ")
STRING_ALIGN = 8


class Record(NamedTuple):
    """One decoded ring record, field for field as stored: ``head`` and ``tail`` both hold its
    position in the ring's total write order + 1 (how a reader knows it is whole)."""

    head: int
    kind: int
    op: int
    flags: int
    phase: int
    pg: int
    op_id: int
    seq: int
    t_ns: int
    nbytes: int
    sig: int
    peer: int
    aux: int
    module: int
    tail: int


def start_aux(bucket_index: int | None, exponent: int | None = None) -> int:
    """START's ``aux`` of a DDP bucket (``bucket_index``; None: no bucket) whose largest value's binary
    exponent is ``exponent`` (None: not known).

    >>> bucket_of(start_aux(3, -7)), exponent_of(start_aux(3, -7))
    (3, -7)
    """
    if bucket_index is None:
        return 0
    held = min(bucket_index + 1, (1 << BUCKET_BITS) - 1)  # a model of 65,535 buckets or more: the last ones as one
    return held | (0 if exponent is None else exponent + EXPONENT_OFFSET) << BUCKET_BITS


def bucket_of(aux: int) -> int:
    """The DDP bucket's index in a START's ``aux``; -1: no bucket."""
    return (aux & (1 << BUCKET_BITS) - 1) - 1


def exponent_of(aux: int) -> int | None:
    """The bucket's largest binary exponent in a START's ``aux``; None: not known."""
    held = aux >> BUCKET_BITS
    return held - EXPONENT_OFFSET if held else None
