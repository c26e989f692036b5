"""Slow outliers: a collective that took over ``factor`` times the running mean of its kind so far.

Example::

    outliers = SlowOutliers(factor=5.0)
    slow = outliers.among(("all_reduce", "0", "4KiB"), [0.001, 0.002, 0.1])   # indices of the slow ones
"""

from __future__ import annotations

from typing import Hashable, Sequence

_EWMA = 0.1
"""The running mean's weight of each new duration."""
_SLOW_AFTER = 20
"""Completions of one kind seen before a slow outlier can be called."""


class SlowOutliers:
    """The running mean of each kind's durations (the sidecar's: (op, group, size class))."""

    def __init__(self, factor: float = 5.0):
        self.factor = factor
        self._typical: dict[Hashable, tuple[float, int]] = {}

    def among(self, kind: Hashable, seconds: Sequence[float]) -> set[int]:
        """Which of ``seconds`` (collectives of ``kind``, in order) are slow outliers; each then counts
        in the running mean."""
        typical, seen = self._typical.get(kind, (seconds[0], 0))
        slow, factor = set(), self.factor
        for k, value in enumerate(seconds):
            if seen >= _SLOW_AFTER and value > factor * typical:
                slow.add(k)
            typical += _EWMA * (value - typical)
            seen += 1
        self._typical[kind] = (typical, seen)
        return slow
