"""``SignalWatcher``: SIGTERM's snapshot, written even while the main thread is blocked in a collective,
by a ``commlens-signals`` thread that ``signal.set_wakeup_fd`` wakes. Neither that thread nor the
Python-level handler takes a lock: the interrupted main thread may hold any. Under SIGTERM's default
action the handler does not wait either: the main thread goes on, letting go of what it holds (the
counters a scrape reads, the scrapes' own count), while the thread writes the snapshot, waits for it to
be scraped and ends the process as SIGTERM would have. See docs/running.md ("Snapshots on the way down").

Example::

    watcher = SignalWatcher(lambda: agent.snapshot("signal", blocking=False), timeout_s=10)
    watcher.install()      # from the main thread; elsewhere it changes nothing
    ...
    watcher.uninstall()    # the previous handler and wakeup fd come back; the thread ends
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable

_libc = ctypes.CDLL(None, use_errno=True)
_libc.signal.argtypes, _libc.signal.restype = (ctypes.c_int, ctypes.c_void_p), ctypes.c_void_p
_SIG_DFL = 0

_installed: SignalWatcher | None = None


class SignalWatcher:
    _reader: socket.socket  # a connected pair, made by install()
    _writer: socket.socket

    def __init__(self, snapshot: Callable[[], Any], timeout_s: float):
        self.snapshot, self.timeout_s = snapshot, timeout_s
        self._previous: Any = None
        self._ends = False  # the previous disposition was the default: SIGTERM ends the process
        self._terminating = False  # SIGTERM came under the default disposition: the thread ends the process
        self._settled = False  # the way out has begun (``_settle``): a SIGTERM from now on is waited for here
        self._own_wakeup = False
        self._done = threading.Event()  # set by the thread when a snapshot is written
        self._pending = 0  # the Python-level handler's calls not yet chained (main thread only)
        self._thread = threading.Thread(target=self._watch, name="commlens-signals", daemon=True)

    def install(self) -> bool:
        """Take SIGTERM; from the main thread only (False elsewhere, and nothing is changed)."""
        global _installed
        if threading.current_thread() is not threading.main_thread():
            return False
        self._previous = signal.getsignal(signal.SIGTERM)
        self._ends = not callable(self._previous) and self._previous != signal.SIG_IGN
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._thread.start()
        theirs = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        if theirs != -1:
            # Someone else's (an asyncio loop's): theirs stays (its warn_on_full_buffer back at the default,
            # there is no way to read it), and our handler hands the signal to our thread itself — still
            # waiting on no lock, but only once the main thread is back in Python.
            signal.set_wakeup_fd(theirs)
        self._own_wakeup = theirs == -1
        signal.signal(signal.SIGTERM, self._on_signal)
        atexit.register(self._settle)  # the main thread may reach the end before the thread ends the process
        _installed = self
        return True

    def uninstall(self) -> None:
        """Give SIGTERM back and end the thread; from the main thread only (elsewhere it stays). After
        a SIGTERM under the default disposition, the process ends here instead, as SIGTERM's default
        does, once the thread's snapshot is written (or its timeout is past)."""
        global _installed
        if _installed is not self or threading.current_thread() is not threading.main_thread():
            return
        self._settle()
        atexit.unregister(self._settle)
        _installed = None
        if signal.getsignal(signal.SIGTERM) == self._on_signal:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
        if self._own_wakeup:
            current = signal.set_wakeup_fd(-1)
            if current != self._writer.fileno():  # replaced by someone since: theirs to keep
                signal.set_wakeup_fd(current)
        self._writer.close()  # the thread reads the end of the stream and returns
        self._thread.join(self.timeout_s)
        self._reader.close()

    def _watch(self) -> None:
        while True:
            try:
                data = self._reader.recv(4096)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM not in data:  # another signal with a Python handler (SIGINT's, say)
                continue
            if self._ends and signal.getsignal(signal.SIGTERM) == self._on_signal:
                self._terminating = True  # before the main thread's handler has run, it may be at its end
            self._done.clear()
            try:
                self.snapshot()
            except Exception as error:  # the process still ends as SIGTERM ends it
                print(f"commlens: no signal snapshot: {error!r}", file=sys.stderr)
            finally:
                self._done.set()
            if self._terminating:
                _end(signal.SIGTERM)

    def _settle(self) -> None:
        """After a SIGTERM under the default disposition, end the process as its default does, once
        the thread's snapshot is written (or its timeout is past); else nothing."""
        self._settled = True
        if self._terminating:
            self._done.wait(self.timeout_s)
            _end(signal.SIGTERM)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """The Python-level handler, on the main thread: under the default disposition, called as the
        handler before the way out, hand the signal to the thread and return (the thread ends the
        process, and the main thread must not sit on what it holds meanwhile); else (a handler of the
        user's chained to this one, the way out begun, another disposition) wait for the thread's
        snapshot, then chain, or end the process."""
        if self._ends and not self._settled and signal.getsignal(signal.SIGTERM) == self._on_signal:
            self._terminating = True
            if not self._own_wakeup:
                self._send(signum)
            return
        self._pending += 1
        if self._pending > 1:  # arrived while an outer call waits or chains below: it chains for this one too
            return
        try:
            if not self._own_wakeup:
                self._send(signum)
            if self._previous != signal.SIG_IGN:
                self._done.wait(self.timeout_s)
                self._done.clear()
            while self._pending:
                self._pending -= 1
                if callable(self._previous):
                    self._previous(signum, frame)
                elif self._ends:
                    _end(signum)
        finally:
            self._pending = 0

    def _send(self, signum: int) -> None:
        """Wake the thread for ``signum`` (the wakeup fd is someone else's)."""
        try:
            self._writer.send(bytes([signum]))
        except OSError:  # full: a snapshot is on its way already
            pass

    def _forget(self) -> None:
        """In a forked child (a DataLoader worker): the socket is shared with the parent, whose thread
        must not take the child's SIGTERM for its own; the child gets SIGTERM as it was before commlens."""
        if self._own_wakeup:
            signal.set_wakeup_fd(-1)
        if signal.getsignal(signal.SIGTERM) == self._on_signal:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
        atexit.unregister(self._settle)
        self._reader.close()
        self._writer.close()


def _end(signum: int) -> None:
    """End the process as ``signum``'s default action does, from any thread: reset it at the C level
    (Python's ``signal.signal`` works on the main thread only), then send it."""
    _libc.signal(signum, _SIG_DFL)
    os.kill(os.getpid(), signum)


def _after_fork_in_child() -> None:
    global _installed
    if _installed is not None:
        _installed._forget()
        _installed = None


os.register_at_fork(after_in_child=_after_fork_in_child)
