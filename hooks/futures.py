"""Completion callbacks on a collective's future that the process waits for when it exits
(``EXIT_WAIT_S``, then ``EXIT_GRACE_S`` for callbacks it does not see): a backend thread still
running one while the interpreter finalizes aborts the rank. See docs/hooks.md.

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
