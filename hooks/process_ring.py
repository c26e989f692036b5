"""This process's ring, and the counting of what commlens loses while writing to it.

Example::

    from commlens.hooks import process_ring
    process_ring.ring().write          # created on first use from COMMLENS_RING_SLOTS / _PATH
    process_ring.internal_error("START", error)   # counted in the ring's header, warned about once
"""

from __future__ import annotations

import os
import threading
import warnings

from commlens.ring.memory import Ring

from ._state import state

_lock = threading.Lock()
_warned = False


def ring() -> Ring:
    """This process's ring, created on first use from ``COMMLENS_RING_SLOTS`` / ``COMMLENS_RING_PATH``
    (unless the agent created it first, in a pod sidecar's folder: ``ring_at``)."""
    if state.ring is None:  # the ring once made: the hot path reads it there, and calls ring() only while None
        with _lock:
            if state.ring is None:
                state.ring = _ring_from_env()
    return state.ring


def ring_at(path: str | None, slots: int) -> Ring:
    """This process's ring, created as the file ``path`` (None: private memory) with ``slots`` slots
    unless it exists (the agent's checked configuration wins over the environment's); a ValueError
    if the process already records into another ring."""
    with _lock:
        current = state.ring
        if current is None:
            current = state.ring = Ring(slots=slots, path=path)
        elif current.path != path:
            raise ValueError(f"commlens already records into {current.path or 'an anonymous ring'}, not {path!r}: "
                             "start commlens before anything else records collectives")
    return current


def _ring_from_env() -> Ring:
    raw = os.environ.get("COMMLENS_RING_SLOTS", "65536")
    try:
        slots = int(raw)
    except ValueError:
        slots = -1
    if slots < 2 or slots & (slots - 1):
        raise ValueError(f"COMMLENS_RING_SLOTS={raw!r} is not accepted: it must be a power of two >= 2")
    path = os.environ.get("COMMLENS_RING_PATH") or None
    if path and "{rank}" in path:
        path = path.format(rank=os.environ.get("RANK", "0"))
    return Ring(slots=slots, path=path)


def count_error(kind: str) -> None:
    """Count lost telemetry in the ring's header (``ERRORS``); nowhere if there is no ring (it could
    not be created: that error is the one the caller is reporting)."""
    if state.ring is not None:
        state.ring.count_error(kind)


def internal_error(where: str, error: Exception) -> None:
    """Count a failure of commlens itself (in the ring's header); warn about the first. The
    collective goes on unrecorded."""
    global _warned
    count_error("recorder")
    if not _warned:
        _warned = True
        warnings.warn(f"commlens could not record a collective ({where}: {error!r}); the collective "
                      "went on unrecorded, and later such errors are only counted", RuntimeWarning, stacklevel=3)
