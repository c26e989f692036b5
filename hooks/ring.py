"""A bounded multi-producer ring of fixed-size collective records that another process can read.

This module is the record's one home — layout, kinds, flags, statuses, phases, the string table —
for writers and readers alike, and imports no torch, so that a reader in another process (the pod
sidecar) need not either.

Layout of the backing memory (an anonymous mapping, or a file such as ``/dev/shm/commlens-0`` that
a sidecar process maps too)::

    header (64 B) | slots × RECORD (72 B each) | string arena (string_bytes)

Producers (``_producer.c``) claim an index with an atomic add on a counter in the header, then
write the slot's head sequence, its payload and its tail sequence, with release ordering: they
never wait and never lock, and producers in several processes may share one ring. A reader
(``_producer.read_whole``, in C for its acquire ordering) loads the tail, copies the slot, then loads
the head: the slot is whole when both equal ``index + 1``, on x86-64 and aarch64 alike; a larger
sequence means the slot was overwritten and the records in between are counted as dropped, exactly.

Strings (group descriptions, tensor signatures) are interned once into the string arena and
referred to by id, so records stay fixed-size. A string of any length takes ``8 + its bytes`` (to a
multiple of 8) claimed with an atomic add on a counter in the header, so producers of any process
get disjoint space and ids; its length is published with release ordering after its bytes, so a
reader in another process resolves every published id, also after the writer has died.

Example::

    ring = Ring(slots=1024)
    t_ns = ring.write(START, 0, 0, ring.intern("0"), 1, 1, 16, 0, -1, 0)
    # kind, op, flags, pg, op_id, seq, nbytes, sig, peer, aux; returns the record's timestamp
    reader = RingReader(ring)
    [record] = reader.read()
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from typing import NamedTuple

START, END, NAN, GPU_START = 1, 2, 3, 4
"""Record kinds: a collective was issued, finished, had a non-finite tensor, started on the GPU."""
NAN_OUTPUT, NAN_HAS_NAN, NAN_HAS_INF = 1, 2, 4
"""Bits of a NAN record's ``flags``: the tensor was an output; it held NaN; it held Inf."""
FLAG_ASYNC, FLAG_LAST_BUCKET = 1, 2
"""Bits of a START record's ``flags``: the op is async; it is a DDP model's last gradient bucket."""
OK, ERROR, TIMEOUT = 0, 1, 2
STATUS = ("ok", "error", "timeout")
"""An END record's ``flags``: the op's status, by index."""
PHASES = ("", "other", "forward", "backward", "optimizer")
"""A record's ``phase``: where in the training step the op was issued (module attribution)."""

from ._producer import Producer, claim, publish, published, read_whole

_HEADER = struct.Struct("<8sIIIIIqI")  # magic, version, slots, record size, string bytes, alignment, clock offset, pid
_HEADER_SIZE = 64
_STRING_CLAIM_OFFSET = 48  # bytes of the string arena claimed so far, a uint64 in the header
_CLAIM_OFFSET = 56  # the producers' next index, a uint64 in the header
_MAGIC = b"CMLNSRNG"
_VERSION = 4
RECORD = struct.Struct("<QBBBBIQQQQIiIIQ")
_SEQ = struct.Struct("<Q")
_TAIL = RECORD.size - _SEQ.size
_STRING_ALIGN = 8
DEFAULT_SLOTS = 1 << 16
DEFAULT_STRING_BYTES = 1 << 20


class Record(NamedTuple):
    """One decoded ring record, field for field as stored: ``head`` and ``tail`` both hold its
    position in the ring's total write order + 1 (how a reader knows it is whole); ``index`` is that
    position."""

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

    @property
    def index(self) -> int:
        return self.head - 1


def _check_power_of_two(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 2 or value & (value - 1):
        raise ValueError(f"{name}={value!r} is not accepted: it must be a power of two >= 2")


class Ring:
    """The ring's memory plus its producer side. ``Ring.attach(path)`` maps another process's ring.

    ``write(kind, op, flags, pg, op_id, seq, nbytes, sig, peer, aux, where=0, t_ns=now) -> t_ns``
    publishes one record, stamped with ``time.monotonic_ns()`` unless ``t_ns`` is given, and returns
    the stamp; ``where`` is ``(module string id << 8) | phase`` (``attribution.py``). It never blocks; when the ring is full it overwrites the oldest record.
    """

    def __init__(self, slots: int = DEFAULT_SLOTS, path: str | None = None, string_bytes: int = DEFAULT_STRING_BYTES):
        _check_power_of_two("slots", slots)
        if not isinstance(string_bytes, int) or string_bytes < _STRING_ALIGN or string_bytes % _STRING_ALIGN:
            raise ValueError(f"string_bytes={string_bytes!r} is not accepted: it must be a multiple of 8, >= 8")
        self.slots, self.string_bytes, self.path = slots, string_bytes, path
        size = _HEADER_SIZE + slots * RECORD.size + string_bytes
        if path is None:
            self._map = mmap.mmap(-1, size)
        else:  # a new file renamed into place: a reader that has the old one mapped keeps it whole
            temporary = f"{path}.{os.getpid()}.new"
            try:
                fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            except OSError as error:
                raise OSError(f"cannot create the ring file {path!r}: {error.strerror}") from error
            try:
                os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        self.clock_offset_ns = time.time_ns() - time.monotonic_ns()
        _HEADER.pack_into(self._map, 0, _MAGIC, _VERSION, slots, RECORD.size, string_bytes, _STRING_ALIGN,
                          self.clock_offset_ns, os.getpid())
        self._view = memoryview(self._map)
        self._strings_at = _HEADER_SIZE + slots * RECORD.size
        self.write = Producer(self._map, slots, _CLAIM_OFFSET, _HEADER_SIZE).write
        self._string_ids: dict[str, int] = {"": 0}
        self._string_cache: dict[int, str] = {0: ""}
        self.strings_dropped = 0
        if path is not None:
            os.replace(temporary, path)

    @classmethod
    def attach(cls, path: str) -> Ring:
        """Map a ring that another process created at ``path``, for reading (and ``string``)."""
        with open(path, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), 0)
        magic, version, slots, record_size, string_bytes, align, offset, _pid = _HEADER.unpack_from(mapped, 0)
        if magic != _MAGIC or version != _VERSION or record_size != RECORD.size or align != _STRING_ALIGN \
                or len(mapped) != _HEADER_SIZE + slots * record_size + string_bytes:
            raise ValueError(f"{path!r} is not a commlens ring of format version {_VERSION}")
        ring = cls.__new__(cls)
        ring.slots, ring.string_bytes, ring.path, ring.clock_offset_ns = slots, string_bytes, path, offset
        ring._map, ring._view = mapped, memoryview(mapped)
        ring._strings_at = _HEADER_SIZE + slots * RECORD.size
        ring._string_ids, ring._string_cache, ring.strings_dropped = {"": 0}, {0: ""}, 0
        ring.write = Producer(mapped, slots, _CLAIM_OFFSET, _HEADER_SIZE).write
        return ring

    def intern(self, text: str) -> int:
        """The id of ``text`` in the string arena, adding it on first use (0 when the arena is full)."""
        found = self._string_ids.get(text)
        if found is not None:
            return found
        encoded = text.encode()
        need = _STRING_ALIGN + -(-len(encoded) // _STRING_ALIGN) * _STRING_ALIGN
        at = claim(self._view, _STRING_CLAIM_OFFSET, need)
        if at + need > self.string_bytes or len(encoded) >= 1 << 32:
            self.strings_dropped += 1
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
        ring, out = self.ring, []
        while len(out) < limit:
            run = self._read_run(limit - len(out))
            if run:
                out.extend(run)
                continue
            index = self.cursor
            head, record = ring.read_slot(index)
            if record is not None:
                out.append(record)
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

    def _read_run(self, limit: int) -> list[Record]:
        """Whole published records from the cursor on, copied out by ``read_whole`` (which says what
        makes a copy whole across processes and CPUs), up to the first that is not (yet) whole. Empty
        when the slow path must decide."""
        ring = self.ring
        data, _ = read_whole(ring._view, ring.slots, _CLAIM_OFFSET, _HEADER_SIZE, self.cursor, limit)
        if not data:
            return []
        make = tuple.__new__  # a Record without NamedTuple's __new__
        run = [make(Record, fields) for fields in RECORD.iter_unpack(data)]
        self.cursor += len(run)
        self._stalled = 0
        return run

    def _stuck_behind_published(self, index: int) -> bool:
        if self.ring.read_slot(index + 1)[1] is None:
            return False
        self._stalled += 1
        return self._stalled > self.patience
