"""Completion callbacks on a collective's future, which the process waits for when it exits.

A future's Python callback runs on the backend's own C++ thread (gloo's workers): that thread takes
the GIL to call it, and once more to drop its reference when the callback is done. If the
interpreter has begun to finalize meanwhile, CPython ends the thread with ``pthread_exit``, whose
unwinding through C++'s ``noexcept`` frames calls ``std::terminate`` — "terminate called without
an active exception", and the rank dies with SIGABRT after training finished. It happens when a
job exits right after a collective completes: a waiter (DDP's reducer, ``work.wait()``) wakes as
soon as the future is marked complete, before its callbacks have run. So ``when_done`` holds each
callback by weak reference until the backend's thread has released it — the last time that thread
touches Python for it — and at exit the process waits (at most ``EXIT_WAIT_S``) for every callback
whose future has completed; ``then`` does the same for a chained callback, whose release is the last
Python of the whole chain. A future still running at exit is not waited for. Callbacks commlens does
not register (a user's DDP hook chaining its own ``then``) are not seen: after its own, the process
lets go of the GIL for ``EXIT_GRACE_S`` more, so that one still unwinding can finish.

Example::

    when_done(work.get_future(), flight._future_done)
    return then(work.get_future(), lambda done: done.value()[0])
"""

from __future__ import annotations

import atexit
import time
import weakref
from typing import Any, Callable

EXIT_WAIT_S = 5.0
EXIT_GRACE_S = 0.05

_held: dict[int, tuple[weakref.ref, Any]] = {}
"""id(callback) -> (a weak reference to it, its future), until the backend has released the callback."""
_at_exit = False


def when_done(future: Any, callback: Callable[[Any], None]) -> None:
    """``future.add_done_callback(callback)``, with the process waiting for it at exit."""
    _hold(future, callback)
    future.add_done_callback(callback)


def then(future: Any, callback: Callable[[Any], Any]) -> Any:
    """``future.then(callback)``, with the process waiting for it at exit; ``callback`` must be an
    object of its own (a new lambda), since it is followed by identity."""
    _hold(future, callback)
    return future.then(callback)


def _hold(future: Any, callback: Callable) -> None:
    global _at_exit
    if not _at_exit:
        _at_exit = True
        atexit.register(wait_for_callbacks)
    key = id(callback)
    _held[key] = (weakref.ref(callback, lambda _, key=key: _held.pop(key, None)), future)


def wait_for_callbacks(timeout_s: float = EXIT_WAIT_S, grace_s: float = EXIT_GRACE_S) -> bool:
    """Wait until no completed future's callback is still held by the backend's thread (the GIL
    is let go meanwhile, so that those threads can finish), then ``grace_s`` for callbacks commlens
    does not see; True if none is left."""
    deadline = time.monotonic() + timeout_s
    while any(future.done() for _, future in list(_held.values())):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    time.sleep(grace_s)
    return True
