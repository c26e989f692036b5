"""How a ring's writer wakes its reader before the ring laps: its producers write a byte each time they
have claimed a quarter of the ring (``_producer.c``'s ``wake_fd``), into a pipe when the reader is a
thread of the writer's process (``Wakeup``), into a FIFO beside the ring's file when it is another
process (``open_wake_file``, read by ``WakeFiles``). Either way the reader sleeps long between drains.

Example::

    wakeup = ring.wake_reader()           # the writer's own sidecar thread
    wakeup.wait(0.5)                      # True: a quarter of the ring filled (or set()); False: 0.5 s passed

    Ring(path=path)                       # a ring made as a file signals through path + ".wake"
    files = WakeFiles(); files.watch(path)
    files.wait(0.5)                       # in the pod sidecar: any of its rings, or 0.5 s
"""

from __future__ import annotations

import contextlib
import os
import select
import threading

from ._producer import Producer


def wake_file(ring_path: str) -> str:
    """The FIFO beside a ring's file through which its writer wakes a reader in another process."""
    return f"{ring_path}.wake"


def open_wake_file(ring_path: str) -> int | None:
    """(The writer) A new FIFO at ``wake_file(ring_path)`` (renamed into place, as the ring's file is),
    open for writing without ever blocking: opened for reading too, so that a write finds a reader
    whether or not one is there (a byte nobody reads fills the FIFO, and a full FIFO already holds a
    wake-up). None where the file system has no FIFOs: the reader then drains on its interval alone."""
    path = wake_file(ring_path)
    temporary = f"{path}.{os.getpid()}.new"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        os.mkfifo(temporary, 0o600)
        fd = os.open(temporary, os.O_RDWR | os.O_NONBLOCK)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        return None
    os.replace(temporary, path)
    return fd


class WakeFiles:
    """(A reader in another process) The wake FIFOs of the rings it follows, waited on together.

    ``watch(ring_path)`` opens one (again, for a ring replaced by a restarted writer); a FIFO whose every
    writer has ended is dropped; ``set()`` wakes the waiter from another thread. One thread waits; any
    thread may watch."""

    def __init__(self) -> None:
        self._files: dict[str, int] = {}
        self._lock = threading.Lock()
        self._own = Wakeup(None)

    def watch(self, ring_path: str) -> None:
        with self._lock:
            self._forget(ring_path)
            with contextlib.suppress(OSError):  # a writer with no FIFO (no FIFOs there): timed drains
                self._files[ring_path] = os.open(wake_file(ring_path), os.O_RDONLY | os.O_NONBLOCK)

    def wait(self, timeout_s: float) -> bool:
        """Sleep until a writer has filled a quarter of its ring since the last wait (or asked for a
        snapshot), ``set()``, or ``timeout_s``; whether woken before it."""
        waiting = select.poll()
        with self._lock:
            watched = dict(self._files)
        for fd in (self._own.fd, *watched.values()):
            waiting.register(fd, select.POLLIN)
        ready = {fd for fd, _ in waiting.poll(timeout_s * 1000)}
        with self._lock:
            for path, fd in watched.items():
                if fd in ready and self._files.get(path) == fd and self._emptied(fd) == b"":  # its writers ended
                    self._forget(path)
        if self._own.fd in ready:
            self._emptied(self._own.fd)
        return bool(ready)

    def set(self) -> None:
        self._own.set()

    def close(self) -> None:
        with self._lock:
            for path in list(self._files):
                self._forget(path)
        self._own.close()

    def _forget(self, ring_path: str) -> None:
        fd = self._files.pop(ring_path, None)
        if fd is not None:
            os.close(fd)

    @staticmethod
    def _emptied(fd: int) -> bytes | None:
        """What was waiting in ``fd`` (b"": end of file), or None when nothing was."""
        try:
            return os.read(fd, 4096)
        except BlockingIOError:
            return None


class Wakeup:
    """A pipe that a ring's producers write a byte to each quarter of the ring they claim (in C, one
    ``write`` per ``slots / 4`` records, on whichever thread claims that record), and its reader waits on;
    with no ``producer``, a pipe only ``set()`` writes to.

    Example::

        wakeup = ring.wake_reader()
        wakeup.wait(0.5)     # True: a quarter of the ring filled (or ``set()``); False: 0.5 s passed
        wakeup.close()
    """

    def __init__(self, producer: Producer | None):
        self._producer = producer
        self.fd, self._write_fd = os.pipe()
        """What the waiter waits on (``select``)."""
        for fd in (self.fd, self._write_fd):
            os.set_blocking(fd, False)
        self._before = -1
        if producer is not None:  # in place of the ring file's FIFO, if it has one, until closed
            self._before, producer.wake_fd = producer.wake_fd, self._write_fd

    def wait(self, timeout_s: float) -> bool:
        """Sleep until the ring has filled a quarter since the last wait, ``set()``, or ``timeout_s``."""
        woken = bool(select.select([self.fd], [], [], timeout_s)[0])
        if woken:
            with contextlib.suppress(BlockingIOError):
                os.read(self.fd, 4096)
        return woken

    def set(self) -> None:
        """Wake the waiter now."""
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes it already
            os.write(self._write_fd, b"\1")

    def close(self) -> None:
        """Detach from the producers, then close the pipe (producers write only while holding the GIL,
        as this does: none can be between reading ``wake_fd`` and writing to it)."""
        if self._producer is not None and self._producer.wake_fd == self._write_fd:
            self._producer.wake_fd = self._before
        os.close(self.fd)
        os.close(self._write_fd)
