"""The ring's memory: a bounded multi-producer ring of fixed-size records (``layout.py``) and a string
arena, in private memory or a file another process maps. Writers write through ``Ring.write`` (C:
``_producer.c``; hooks/record.py names the fields); readers read through ``reader.RingReader``.
Memory: ``header (128 B) | slots × RECORD (72 B) | string arena``. Imports no torch. See
docs/hooks.md ("Reading a ring from another process").

Example::

    ring = Ring(slots=1024, path="/dev/shm/commlens/local-rank-0.ring")
    sid = ring.intern("default_pg")       # a string records refer to by id
    record.start(ring.write, ...)         # hooks/record.py: the writers
    Ring.attach(ring.path).string(sid)    # "default_pg", in another process
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import struct
import time
import weakref

from ._producer import Producer, claim, publish, published, read_whole
from .layout import (CLAIM_OFFSET, CLOCK_OFFSET, CLOSED_OFFSET, CURSOR_OFFSET, ERRORS, ERRORS_OFFSET, HEADER,
                     HEADER_SIZE, INFO_OFFSET, MAGIC, PID_OFFSET, RECORD, STRING_ALIGN, STRING_CLAIM_OFFSET,
                     VERSION, Record)
from .wakeups import Wakeup, open_wake_file

_U32, _I64, _SEQ = struct.Struct("<I"), struct.Struct("<q"), struct.Struct("<Q")
DEFAULT_SLOTS = 1 << 16
DEFAULT_STRING_BYTES = 1 << 20


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
        if not isinstance(string_bytes, int) or string_bytes < STRING_ALIGN or string_bytes % STRING_ALIGN:
            raise ValueError(f"string_bytes={string_bytes!r} is not accepted: it must be a multiple of 8, >= 8")
        size = HEADER_SIZE + slots * RECORD.size + string_bytes
        self._fd = self._wake_fd = None
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
        HEADER.pack_into(mapped, 0, MAGIC, VERSION, slots, RECORD.size, string_bytes, STRING_ALIGN)
        _I64.pack_into(mapped, CLOCK_OFFSET, time.time_ns() - time.monotonic_ns())
        _U32.pack_into(mapped, PID_OFFSET, os.getpid())
        self._mapped(mapped, slots, string_bytes, path)
        if path is not None:  # its wake FIFO first: a reader that finds the ring finds that too
            self._wake_fd = open_wake_file(path)
            self.producer.wake_fd = -1 if self._wake_fd is None else self._wake_fd
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
        magic, version, slots, record_size, string_bytes, align = HEADER.unpack_from(mapped, 0) \
            if len(mapped) >= HEADER_SIZE else (b"", 0, 0, 0, 0, 0)
        if magic != MAGIC or version != VERSION or record_size != RECORD.size or align != STRING_ALIGN \
                or len(mapped) != HEADER_SIZE + slots * record_size + string_bytes:
            mapped.close()
            os.close(fd)
            raise ValueError(f"{path!r} is not a commlens ring of format version {VERSION}")
        ring = cls.__new__(cls)
        ring._fd, ring._wake_fd = fd, None
        ring._mapped(mapped, slots, string_bytes, path)
        return ring

    def _mapped(self, mapped: mmap.mmap, slots: int, string_bytes: int, path: str | None) -> None:
        self.slots, self.string_bytes, self.path = slots, string_bytes, path
        self._map, self._view = mapped, memoryview(mapped)
        self.clock_offset_ns = _I64.unpack_from(mapped, CLOCK_OFFSET)[0]
        self.pid = _U32.unpack_from(mapped, PID_OFFSET)[0]
        self._strings_at = HEADER_SIZE + slots * RECORD.size
        self._string_ids: dict[str, int] = {"": 0}
        self._string_cache: dict[int, str] = {0: ""}
        self.producer = Producer(mapped, slots, CLAIM_OFFSET, HEADER_SIZE)
        """What ``write`` is a method of; C++ writes through it (``_producer.write_record``)."""
        self.write = self.producer.write

    def wake_reader(self) -> Wakeup:
        """(The writer's process) A ``Wakeup`` that this process's producers signal each time they have
        claimed a quarter of the ring: its reader can sleep long and still drain before the ring laps.
        One at a time; ``Wakeup.close()`` detaches it. (A ring made as a file signals a reader in another
        process, the pod sidecar, through the FIFO beside it until then: ``wakeups.WakeFiles``.)"""
        return Wakeup(self.producer)

    def wake(self) -> None:
        """(The writer's process) Wake a reader in another process now (a SNAPSHOT request it should not
        wait a drain interval for); nothing for a ring without a wake FIFO."""
        if self._wake_fd is not None:
            with contextlib.suppress(BlockingIOError):  # a full FIFO wakes it already
                os.write(self._wake_fd, b"\1")

    def __del__(self) -> None:
        if getattr(self, "_wake_fd", None) is not None:
            self._forget_wake_file()
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def _forget_wake_file(self) -> None:
        """Stop signalling through the wake FIFO and close it (the producer may outlive the ring)."""
        if self.producer.wake_fd == self._wake_fd:
            self.producer.wake_fd = -1
        os.close(self._wake_fd)
        self._wake_fd = None

    # -- the header ---------------------------------------------------------------------------------

    def describe(self, writer: dict) -> None:
        """Record who writes this ring (rank, job, ...) for readers in other processes: ``info()``."""
        _U32.pack_into(self._view, INFO_OFFSET, self.intern(json.dumps(writer)))

    def info(self) -> dict:
        """What ``describe`` recorded; {} when nothing was."""
        try:
            return json.loads(self.string(_U32.unpack_from(self._view, INFO_OFFSET)[0]) or "{}")
        except ValueError:
            return {}

    def count_error(self, kind: str) -> None:
        """Count one piece of telemetry lost, by its ``ERRORS`` kind (atomically: any thread or process)."""
        claim(self._view, ERRORS_OFFSET + 8 * ERRORS.index(kind), 1)

    def errors(self) -> dict[str, int]:
        """Telemetry the writer lost so far, by ``ERRORS`` kind."""
        return dict(zip(ERRORS, struct.unpack_from(f"<{len(ERRORS)}Q", self._view, ERRORS_OFFSET)))

    @property
    def cursor(self) -> int:
        """The index its reader (the sidecar) reads next: records below it were handled once already."""
        return _SEQ.unpack_from(self._view, CURSOR_OFFSET)[0]

    @cursor.setter
    def cursor(self, index: int) -> None:
        _SEQ.pack_into(self._view, CURSOR_OFFSET, index)

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
        _U32.pack_into(self._view, CLOSED_OFFSET, 0)

    def close(self) -> None:
        """(The writer) Mark the ring closed cleanly and let go of its flock; records written after
        it are still read."""
        _U32.pack_into(self._view, CLOSED_OFFSET, 1)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def closed(self) -> bool:
        return bool(_U32.unpack_from(self._view, CLOSED_OFFSET)[0])

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
        need = STRING_ALIGN + -(-len(encoded) // STRING_ALIGN) * STRING_ALIGN
        at = claim(self._view, STRING_CLAIM_OFFSET, need)
        if at + need > self.string_bytes or len(encoded) >= 1 << 32:
            self.count_error("string_dropped")
            return 0
        start = self._strings_at + at
        self._view[start + STRING_ALIGN:start + STRING_ALIGN + len(encoded)] = encoded
        publish(self._view, start, len(encoded) + 1)  # + 1: 0 means not published yet
        sid = at // STRING_ALIGN + 1
        self._string_cache[sid] = text
        return self._string_ids.setdefault(text, sid)

    def string(self, sid: int) -> str:
        """The text of string id ``sid`` (also for a ring attached from another process); "" for an id
        not published (yet)."""
        text = self._string_cache.get(sid)
        if text is None:
            start = self._strings_at + (sid - 1) * STRING_ALIGN
            if sid < 1 or start + STRING_ALIGN > len(self._view):
                return ""
            length = published(self._view, start) - 1
            if length < 0:
                return ""
            text = bytes(self._view[start + STRING_ALIGN:start + STRING_ALIGN + length]).decode(errors="replace")
            self._string_cache[sid] = text
        return text

    def claimed(self) -> int:
        """How many indices producers have claimed so far (the next record's index)."""
        return _SEQ.unpack_from(self._view, CLAIM_OFFSET)[0]

    def read_slot(self, index: int) -> tuple[int, Record | None]:
        """The sequence found in ``index``'s slot and, when it holds exactly that index whole, its record
        (``read_whole``'s protocol; (0, None) for an index not claimed yet)."""
        data, head = read_whole(self._view, self.slots, CLAIM_OFFSET, HEADER_SIZE, index, 1)
        if data:
            return index + 1, tuple.__new__(Record, RECORD.unpack(data))
        return head, None

    def snapshot(self) -> list[Record]:
        """Every whole record now in the ring, oldest first, without moving any reader."""
        found = []
        for slot in range(self.slots):
            (head,) = _SEQ.unpack_from(self._view, HEADER_SIZE + slot * RECORD.size)
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
        if ring._wake_fd is not None:  # nor does the FIFO stay open in it: its end is the writer's
            ring._forget_wake_file()
    _writers.clear()


os.register_at_fork(after_in_child=_forget_writers_in_child)
