"""The ring's read side: a cursor over a ring's records that counts what it lost (``RingReader``), and
the fold of a read's common case (``Folded``, C: ``_fold.c``). Imports no torch and nothing that writes.

Example::

    reader = RingReader(Ring.attach(path))
    records = reader.read()                      # new records, oldest first; reader.dropped: lapped
    records, folded = reader.read_folded()       # the same, each group of plain collectives folded
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from ._fold import fold_run
from ._producer import read_whole
from .layout import CLAIM_OFFSET, HEADER_SIZE, RECORD, Record
from .memory import Ring


class Folded(NamedTuple):
    """Collectives of one (op, pg, nbytes, sig, peer) that started and ended ok within one read, folded by
    ``RingReader.read_folded``: their seqs (uint64) and durations in seconds (float64), in order,
    their own records (``records(k)``) and, for collectives timed on a GPU (START, GPU_START, END),
    their time queued and executing there (``gpu_seconds()``)."""

    op: int
    pg: int
    nbytes: int
    sig: int
    seq_bytes: bytes
    seconds_bytes: bytes
    record_bytes: bytes
    gpu_bytes: bytes
    """float64 (queue, execution) pairs; empty when the group was not timed on a GPU."""
    nan: int
    """``NAN_HAS_*`` bits its collectives' inputs held, each told by a NAN record (0: finite)."""

    def seqs(self) -> memoryview:
        return memoryview(self.seq_bytes).cast("Q")

    def seconds(self) -> memoryview:
        return memoryview(self.seconds_bytes).cast("d")

    def gpu_seconds(self) -> tuple[memoryview, memoryview]:
        """(queued, executing) seconds of each collective on the GPU; empty when not on a GPU."""
        pairs = memoryview(self.gpu_bytes).cast("d")
        return pairs[0::2], pairs[1::2]

    def record_count(self) -> int:
        """How many records the group folded away (its collectives' own, and their NAN records)."""
        return len(self.record_bytes) // RECORD.size + (len(self.seq_bytes) // 8 if self.nan else 0)

    def records(self, k: int) -> tuple[Record, ...]:
        """The ``k``-th collective's records: START and END, or START, GPU_START and END."""
        size = (3 if self.gpu_bytes else 2) * RECORD.size
        return tuple(map(Record._make, RECORD.iter_unpack(memoryview(self.record_bytes)[k * size:(k + 1) * size])))


class RingReader:
    """A cursor over a ring: ``read()`` returns new records in order and counts what was overwritten.

    ``dropped`` is exact: every index the reader skips because a producer lapped it, or because a
    producer claimed it and never published it (the slot stayed empty while later ones filled, for
    ``patience`` reads), is counted once.
    """

    def __init__(self, ring: Ring, start: int = 0, patience: int = 3):
        self.ring, self.cursor, self.patience = ring, start, patience
        self.dropped = 0
        self._stalled = 0

    def read(self, limit: int = 1 << 20) -> list[Record]:
        return self._read(limit, _records)

    def read_folded(self, limit: int = 1 << 20) -> tuple[list[Record], list[Folded]]:
        """``read()``, with each START whose END (status ok) comes in the same read, and no other
        record of its op but its GPU_START and its input's NAN before it, folded into one ``Folded``
        per (op, pg, nbytes, sig, peer, on a GPU or not, NAN flags): a reader's common case, counted a group
        at a time. ``limit`` bounds the records read. A reader handles the records left before the
        groups: collectives with NAN records are folded only where that order is theirs too, a read
        holding no LOSS_SCALE (whose step they may belong to)."""
        pieces = self._read(limit, lambda data: [data])  # runs of whole records, and records one at a time
        data = b"".join(piece if isinstance(piece, bytes) else RECORD.pack(*piece) for piece in pieces)
        records, folded = fold_run(data, Record)
        make = tuple.__new__  # a NamedTuple without its __new__
        return records, [make(Folded, group) for group in folded]

    def _read(self, limit: int, decode: Callable[[bytes], list]) -> list:
        ring, out, left = self.ring, [], limit
        while left > 0:
            data = self._read_run(left)
            if data:
                out.extend(decode(data))
                left -= len(data) // RECORD.size
                continue
            index = self.cursor
            head, record = ring.read_slot(index)
            if record is not None:
                out.append(record)
                left -= 1
                self.cursor = index + 1
                self._stalled = 0
            elif head > index + 1:
                # Lapped: the slot holds index head-1, so indices index .. head-1-slots are gone.
                lost = head - ring.slots - index
                self.dropped += lost
                self.cursor = index + lost
            elif self._stuck_behind_published(index):
                self.dropped += 1
                self.cursor = index + 1
            else:
                break
        return out

    def _read_run(self, limit: int) -> bytes:
        """Whole published records from the cursor on (at most ``limit``), copied out by
        ``read_whole`` (which says what makes a copy whole across processes and CPUs), up to the first
        that is not (yet) whole. Empty when the slow path must decide."""
        ring = self.ring
        data, _ = read_whole(ring._view, ring.slots, CLAIM_OFFSET, HEADER_SIZE, self.cursor, limit)
        if data:
            self.cursor += len(data) // RECORD.size
            self._stalled = 0
        return data

    def _stuck_behind_published(self, index: int) -> bool:
        if self.ring.read_slot(index + 1)[1] is None:
            return False
        self._stalled += 1
        return self._stalled > self.patience


def _records(data: bytes) -> list[Record]:
    make = tuple.__new__  # a Record without NamedTuple's __new__
    return [make(Record, fields) for fields in RECORD.iter_unpack(data)]
