"""A bounded multi-producer ring of fixed-size collective records that another process can read:
the record's one home (layout, kinds, flags, statuses, phases, the string arena, the header), for
writers and readers alike. Imports no torch. Memory: ``header (128 B) | slots × RECORD (72 B) |
string arena``. See docs/hooks.md ("Reading a ring from another process").

Example::

    ring = Ring(slots=1024)
    t_ns = record.start(ring.write, 0, ring.intern("0"), 1, 1, 16, 0, -1)   # hooks/record.py: the writers
    reader = RingReader(ring)
    [record] = reader.read()
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import select
import struct
import time
import weakref
from typing import Callable, NamedTuple

START, END, NAN, GPU_START, SNAPSHOT, LOSS_SCALE = 1, 2, 3, 4, 5, 6
"""Record kinds: a collective was issued, finished, had a non-finite tensor, started on the GPU; the
writer asks its reader for a flight-recorder snapshot (``flags``: the reason's index in ``REASONS``);
a loss scaler began or ended a step (``flags``: the index in ``LOSS_SCALE_EVENTS``)."""
REASONS = ("abort", "hang", "signal", "exception", "peer", "exit")
"""Why a snapshot was written (each one's meaning: ``commlens_abort_snapshots_total`` in docs/metrics.md)."""
ERRORS = ("hook", "recorder", "string_dropped", "work_unjudged", "gpu_pool_exhausted", "gpu_captured")
"""What the writer lost, counted in the header (``commlens_telemetry_errors_total`` in docs/metrics.md)."""
LOSS_SCALE_EVENTS = ("scaled", "applied", "skipped", "made")
"""A loss scaler (``torch.amp.GradScaler``) scaled a loss: the step's gradients follow; it ended the
step and applied it; it skipped it, the gradients holding Inf or NaN; it was made, enabled: its first
step begins (hooks/loss_scale.py)."""
NAN_OUTPUT, NAN_HAS_NAN, NAN_HAS_INF = 1, 2, 4
"""Bits of a NAN record's ``flags``: the tensor was an output; it held NaN; it held Inf."""
FLAG_ASYNC, FLAG_LAST_BUCKET = 1, 2
"""Bits of a START record's ``flags``: the op is async; it is a DDP model's last gradient bucket."""
OK, ERROR, TIMEOUT, NOT_ISSUED = 0, 1, 2, 3
STATUS = ("ok", "error", "timeout", "not_issued")
"""An END record's ``flags``: the op's status, by index. ``not_issued``: a DDP bucket whose communication
hook issued no collective (``noop_hook``); it is no collective, and readers of the ring drop it."""
PHASES = ("", "other", "forward", "backward", "optimizer")
"""A record's ``phase``: where in the training step the op was issued (module attribution)."""

from ._fold import fold_run
from ._producer import Producer, claim, publish, published, read_whole

_HEADER = struct.Struct("<8sIIIII")  # magic, version, slots, record size, string bytes, alignment
_HEADER_SIZE = 128
_INFO_OFFSET = 28  # the string id of the writer's description (uint32)
_CLOCK_OFFSET = 32  # wall clock - monotonic clock of the writer, ns (int64)
_PID_OFFSET = 40  # the writer's pid (uint32)
_CLOSED_OFFSET = 44  # 1 once the writer closed the ring (uint32)
_STRING_CLAIM_OFFSET = 48  # bytes of the string arena claimed so far (uint64)
_CLAIM_OFFSET = 56  # the producers' next index (uint64)
_CURSOR_OFFSET = 64  # the reader's next index (uint64)
_ERRORS_OFFSET = 72  # one uint64 per ERRORS kind
_U32, _I64 = struct.Struct("<I"), struct.Struct("<q")
_MAGIC = b"CMLNSRNG"
_VERSION = 5
RECORD = struct.Struct("<QBBBBIQQQQIiIIQ")
_SEQ = struct.Struct("<Q")
_STRING_ALIGN = 8
DEFAULT_SLOTS = 1 << 16
DEFAULT_STRING_BYTES = 1 << 20


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


def ring_file(folder: str, local_rank: int) -> str:
    """Where the rank with ``local_rank`` keeps its ring in a pod sidecar's ``folder`` (``RING_FILES``)."""
    return os.path.join(folder, f"local-rank-{local_rank}.ring")


RING_FILES = "local-rank-*.ring"


class Ring:
    """The ring's memory plus its producer side. ``Ring.attach(path)`` maps another process's ring.

    ``write`` (arguments: ``record.Write``) publishes one record, stamped with ``time.monotonic_ns()``
    unless ``t_ns`` is given, and returns the stamp. It never blocks: a full ring's oldest record is
    overwritten."""

    def __init__(self, slots: int = DEFAULT_SLOTS, path: str | None = None, string_bytes: int = DEFAULT_STRING_BYTES):
        if not isinstance(slots, int) or slots < 2 or slots & (slots - 1):
            raise ValueError(f"slots={slots!r} is not accepted: it must be a power of two >= 2")
        if not isinstance(string_bytes, int) or string_bytes < _STRING_ALIGN or string_bytes % _STRING_ALIGN:
            raise ValueError(f"string_bytes={string_bytes!r} is not accepted: it must be a multiple of 8, >= 8")
        size = _HEADER_SIZE + slots * RECORD.size + string_bytes
        self._fd = None
        if path is None:
            mapped = mmap.mmap(-1, size)
        else:  # a new file renamed into place: a reader that has the old one mapped keeps it whole
            temporary = f"{path}.{os.getpid()}.new"
            try:
                fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            except OSError as error:
                raise OSError(error.errno, f"cannot create the ring file {path!r}: {error.strerror}") from error
            try:
                os.ftruncate(fd, size)
                mapped = mmap.mmap(fd, size)  # which keeps a duplicate of fd, sharing its open file
            finally:
                os.close(fd)
            self._lock(temporary)
        _HEADER.pack_into(mapped, 0, _MAGIC, _VERSION, slots, RECORD.size, string_bytes, _STRING_ALIGN)
        _I64.pack_into(mapped, _CLOCK_OFFSET, time.time_ns() - time.monotonic_ns())
        _U32.pack_into(mapped, _PID_OFFSET, os.getpid())
        self._mapped(mapped, slots, string_bytes, path)
        if path is not None:
            os.replace(temporary, path)

    @classmethod
    def attach(cls, path: str) -> Ring:
        """Map a ring that another process created at ``path``, to read it (and ``string``)."""
        fd = os.open(path, os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, 0)
        except (OSError, ValueError):
            os.close(fd)
            raise ValueError(f"{path!r} is not a commlens ring: it cannot be mapped (empty?)") from None
        magic, version, slots, record_size, string_bytes, align = _HEADER.unpack_from(mapped, 0) \
            if len(mapped) >= _HEADER_SIZE else (b"", 0, 0, 0, 0, 0)
        if magic != _MAGIC or version != _VERSION or record_size != RECORD.size or align != _STRING_ALIGN \
                or len(mapped) != _HEADER_SIZE + slots * record_size + string_bytes:
            mapped.close()
            os.close(fd)
            raise ValueError(f"{path!r} is not a commlens ring of format version {_VERSION}")
        ring = cls.__new__(cls)
        ring._fd = fd
        ring._mapped(mapped, slots, string_bytes, path)
        return ring

    def _mapped(self, mapped: mmap.mmap, slots: int, string_bytes: int, path: str | None) -> None:
        self.slots, self.string_bytes, self.path = slots, string_bytes, path
        self._map, self._view = mapped, memoryview(mapped)
        self.clock_offset_ns = _I64.unpack_from(mapped, _CLOCK_OFFSET)[0]
        self.pid = _U32.unpack_from(mapped, _PID_OFFSET)[0]
        self._strings_at = _HEADER_SIZE + slots * RECORD.size
        self._string_ids: dict[str, int] = {"": 0}
        self._string_cache: dict[int, str] = {0: ""}
        self.producer = Producer(mapped, slots, _CLAIM_OFFSET, _HEADER_SIZE)
        """What ``write`` is a method of; C++ writes through it (``_producer.write_record``)."""
        self.write = self.producer.write

    def wake_reader(self) -> Wakeup:
        """(The writer's process) A ``Wakeup`` that this process's producers signal each time they have
        claimed a quarter of the ring: its reader can sleep long and still drain before the ring laps.
        One at a time; ``Wakeup.close()`` detaches it."""
        return Wakeup(self.producer)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    # -- the header ---------------------------------------------------------------------------------

    def describe(self, writer: dict) -> None:
        """Record who writes this ring (rank, job, ...) for readers in other processes: ``info()``."""
        _U32.pack_into(self._view, _INFO_OFFSET, self.intern(json.dumps(writer)))

    def info(self) -> dict:
        """What ``describe`` recorded; {} when nothing was."""
        try:
            return json.loads(self.string(_U32.unpack_from(self._view, _INFO_OFFSET)[0]) or "{}")
        except ValueError:
            return {}

    def count_error(self, kind: str) -> None:
        """Count one piece of telemetry lost, by its ``ERRORS`` kind (atomically: any thread or process)."""
        claim(self._view, _ERRORS_OFFSET + 8 * ERRORS.index(kind), 1)

    def errors(self) -> dict[str, int]:
        """Telemetry the writer lost so far, by ``ERRORS`` kind."""
        return dict(zip(ERRORS, struct.unpack_from(f"<{len(ERRORS)}Q", self._view, _ERRORS_OFFSET)))

    @property
    def cursor(self) -> int:
        """The index its reader (the sidecar) reads next: records below it were handled once already."""
        return _SEQ.unpack_from(self._view, _CURSOR_OFFSET)[0]

    @cursor.setter
    def cursor(self, index: int) -> None:
        _SEQ.pack_into(self._view, _CURSOR_OFFSET, index)

    def _lock(self, path: str) -> None:
        """(The writer) Take the flock that says it lives (see ``writer_alive``), on an open file of its
        own: not the mapping's, which a forked child (a data-loader worker) keeps as long as it lives."""
        self._fd = os.open(path, os.O_RDONLY)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _writers.add(self)

    def open(self) -> None:
        """(The writer) Mark the ring in use again after ``close()``; its flock is taken again."""
        if self._fd is None and self.path is not None:
            self._lock(self.path)
        _U32.pack_into(self._view, _CLOSED_OFFSET, 0)

    def close(self) -> None:
        """(The writer) Mark the ring closed cleanly and let go of its flock; records written after
        it are still read."""
        _U32.pack_into(self._view, _CLOSED_OFFSET, 1)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def closed(self) -> bool:
        return bool(_U32.unpack_from(self._view, _CLOSED_OFFSET)[0])

    def writer_alive(self) -> bool:
        """(A reader) Whether the writing process still lives: it holds the file's flock until it
        ends, however it ends (a frozen writer is alive). True for a ring with no file."""
        if self._fd is None:
            return True
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def intern(self, text: str) -> int:
        """The id of ``text`` in the string arena, adding it on first use (0 when the arena is full)."""
        found = self._string_ids.get(text)
        if found is not None:
            return found
        encoded = text.encode()
        need = _STRING_ALIGN + -(-len(encoded) // _STRING_ALIGN) * _STRING_ALIGN
        at = claim(self._view, _STRING_CLAIM_OFFSET, need)
        if at + need > self.string_bytes or len(encoded) >= 1 << 32:
            self.count_error("string_dropped")
            return 0
        start = self._strings_at + at
        self._view[start + _STRING_ALIGN:start + _STRING_ALIGN + len(encoded)] = encoded
        publish(self._view, start, len(encoded) + 1)  # + 1: 0 means not published yet
        sid = at // _STRING_ALIGN + 1
        self._string_cache[sid] = text
        return self._string_ids.setdefault(text, sid)

    def string(self, sid: int) -> str:
        """The text of string id ``sid`` (also for a ring attached from another process); "" for an id
        not published (yet)."""
        text = self._string_cache.get(sid)
        if text is None:
            start = self._strings_at + (sid - 1) * _STRING_ALIGN
            if sid < 1 or start + _STRING_ALIGN > len(self._view):
                return ""
            length = published(self._view, start) - 1
            if length < 0:
                return ""
            text = bytes(self._view[start + _STRING_ALIGN:start + _STRING_ALIGN + length]).decode(errors="replace")
            self._string_cache[sid] = text
        return text

    def claimed(self) -> int:
        """How many indices producers have claimed so far (the next record's index)."""
        return _SEQ.unpack_from(self._view, _CLAIM_OFFSET)[0]

    def read_slot(self, index: int) -> tuple[int, Record | None]:
        """The sequence found in ``index``'s slot and, when it holds exactly that index whole, its record
        (``read_whole``'s protocol; (0, None) for an index not claimed yet)."""
        data, head = read_whole(self._view, self.slots, _CLAIM_OFFSET, _HEADER_SIZE, index, 1)
        if data:
            return index + 1, tuple.__new__(Record, RECORD.unpack(data))
        return head, None

    def snapshot(self) -> list[Record]:
        """Every whole record now in the ring, oldest first, without moving any reader."""
        found = []
        for slot in range(self.slots):
            (head,) = _SEQ.unpack_from(self._view, _HEADER_SIZE + slot * RECORD.size)
            if head:
                _, record = self.read_slot(head - 1)
                if record is not None:
                    found.append(record)
        found.sort()
        return found


_writers: weakref.WeakSet[Ring] = weakref.WeakSet()
"""Rings this process writes to a file. A forked child (a data-loader worker) closes its copies of
their descriptors, so that the flock goes with the writer and not with the last of its children."""


def _forget_writers_in_child() -> None:
    for ring in list(_writers):
        if ring._fd is not None:
            os.close(ring._fd)
            ring._fd = None
    _writers.clear()


os.register_at_fork(after_in_child=_forget_writers_in_child)


class Wakeup:
    """A pipe that a ring's producers write a byte to each quarter of the ring they claim (in C, one
    ``write`` per ``slots / 4`` records, on whichever thread claims that record), and its reader waits on.

    Example::

        wakeup = ring.wake_reader()
        wakeup.wait(0.5)     # True: a quarter of the ring filled (or ``set()``); False: 0.5 s passed
        wakeup.close()
    """

    def __init__(self, producer: Producer):
        self._producer = producer
        self._read_fd, self._write_fd = os.pipe()
        for fd in (self._read_fd, self._write_fd):
            os.set_blocking(fd, False)
        producer.wake_fd = self._write_fd

    def wait(self, timeout_s: float) -> bool:
        """Sleep until the ring has filled a quarter since the last wait, ``set()``, or ``timeout_s``."""
        woken = bool(select.select([self._read_fd], [], [], timeout_s)[0])
        if woken:
            with contextlib.suppress(BlockingIOError):
                os.read(self._read_fd, 4096)
        return woken

    def set(self) -> None:
        """Wake the waiter now."""
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes it already
            os.write(self._write_fd, b"\1")

    def close(self) -> None:
        """Detach from the producers, then close the pipe (producers write only while holding the GIL,
        as this does: none can be between reading ``wake_fd`` and writing to it)."""
        if self._producer.wake_fd == self._write_fd:
            self._producer.wake_fd = -1
        os.close(self._read_fd)
        os.close(self._write_fd)


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
        records, folded = fold_run(data, Record, START, END, GPU_START, NAN, NAN_OUTPUT, LOSS_SCALE)
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
        data, _ = read_whole(ring._view, ring.slots, _CLAIM_OFFSET, _HEADER_SIZE, self.cursor, limit)
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
