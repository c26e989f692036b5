"""Completion of async works that have no future, without anyone blocking on ``wait()``.

Example::

    poller.watch(work, flight)      # flight.complete(...) once work says it completed, or is waited for
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Protocol

from commlens.ring.layout import OK

from . import process_ring
from .record import status_of


class InFlight(Protocol):
    """What the poller completes (``recorder.InFlight``)."""

    work: Any

    def complete(self, status: int, error: BaseException | None) -> Any: ...


class CompletionPoller:
    """Completes async works that have no future (gloo point-to-point, gloo reduce_scatter), so the
    post-hook fires at completion without anyone blocking on ``wait()``: when ``wait()`` returns
    (``waited``), when a polling thread sees ``is_completed()``, or, dropped unjudged, counted as
    ``work_unjudged`` (docs/hooks.md). Works are held by weak reference.
    """

    FIRST_PERIOD_S, LAST_PERIOD_S = 0.0005, 0.05

    def __init__(self) -> None:
        self._pending: dict[int, tuple[weakref.ref, InFlight]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.RLock()  # a weak reference's callback may run while it is held

    def watch(self, work: Any, call: InFlight) -> None:
        key = id(work)
        with self._lock:
            self._pending[key] = (weakref.ref(work, lambda _, key=key: self._dropped(key)), call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="commlens-completion", daemon=True)
                self._thread.start()
        self._wake.set()

    def _take(self, key: int) -> InFlight | None:
        with self._lock:
            entry = self._pending.pop(key, None)
        return None if entry is None else entry[1]

    def waited(self, work: Any, error: BaseException | None) -> None:
        """``work.wait()`` returned (or raised ``error``): its op has completed."""
        self._complete(id(work), work, error)

    def _complete(self, key: int, work: Any, error: BaseException | None) -> None:
        """Complete the op of ``work`` (watched as ``key``) unless that was done already."""
        call = self._take(key)
        if call is not None:
            call.work = work
            call.complete(status_of(error), error)
            call.work = None

    def _dropped(self, key: int) -> None:
        call = self._take(key)
        if call is not None:
            process_ring.count_error("work_unjudged")
            call.complete(OK, None)

    def _run(self) -> None:
        period = self.FIRST_PERIOD_S
        while True:
            if not self._pending:
                self._wake.wait()
                period = self.FIRST_PERIOD_S
            self._wake.clear()
            period = self.FIRST_PERIOD_S if self._poll() else min(period * 2, self.LAST_PERIOD_S)
            if self._pending:
                self._wake.wait(period)

    def _poll(self) -> bool:
        """Complete the watched works that say they completed; True if any did. Holds no work after."""
        with self._lock:
            pending = list(self._pending.items())
        completed = False
        for key, (ref, _) in pending:
            work = ref()
            if work is None:
                continue
            try:
                if not work.is_completed():
                    continue
                work.wait()  # completed: returns at once, or raises its error (is_success is deprecated)
                error = None
            except Exception as raised:  # its error, or a work that cannot say: it failed
                error = raised
            completed = True
            self._complete(key, work, error)  # nothing when the wrapper of Work.wait completed it just now
        return completed


poller = CompletionPoller()


def waited(original: Callable) -> Callable:
    """``Work.wait`` that tells the poller when a watched work has been waited for."""

    def wait(work, *args, **kwargs):
        if not poller._pending:
            return original(work, *args, **kwargs)
        try:
            result = original(work, *args, **kwargs)
        except BaseException as error:
            poller.waited(work, error)
            raise
        poller.waited(work, None)
        return result

    wait.__wrapped__ = original
    return wait
