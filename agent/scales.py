"""Each DDP gradient bucket's scale on this rank: the largest binary exponent among its values, which the
C++ hook's pass over the bucket finds as it divides it (START's aux, ``layout.exponent_of``). A bucket
whose largest value grew ``2**SCALE_JUMP`` or more over the bucket's own recent scale (its median over the
last ``WINDOW`` steps) is a jump: a value flipped high (a bit of its exponent), or the rank's gradients
grown (a rank computing wrong). Its peers' buckets tell which: the rules and ``diagnose`` name a rank that
jumped where its replicas did not (docs/verdicts.md, "diverging input").

Example::

    scales = BucketScales()
    grown = scales.seen(("3", 0, 4096), -7)   # group "3"'s bucket 0 of 4 KiB: None, or by how many orders it grew
"""

from __future__ import annotations

import collections

WINDOW = 16
"""Steps of a bucket whose scales its median is taken over."""
JUDGED_FROM = 8
"""Steps of a bucket seen before it is judged: a job's first steps (warm-up) set its scale."""
SCALE_JUMP = 8
"""Binary orders over its recent scale that make a jump (256 times): healthy buckets move a few orders
from step to step (data, learning rate), not eight at once."""


class BucketScales:
    """The last ``WINDOW`` scales of each bucket seen, by (group, index, bytes): two models of one group
    (a GAN's two) each have a bucket 0, of their own sizes."""

    def __init__(self) -> None:
        self._recent: dict[tuple[str, int, int], collections.deque[int]] = {}

    def seen(self, bucket: tuple[str, int, int], exponent: int) -> int | None:
        """``bucket`` held values up to ``2**exponent``: by how many binary orders it grew over its recent
        scale, where that is ``SCALE_JUMP`` or more; else None."""
        recent = self._recent.get(bucket)
        if recent is None:
            recent = self._recent[bucket] = collections.deque(maxlen=WINDOW)
        grown = None
        if len(recent) >= JUDGED_FROM:
            median = sorted(recent)[len(recent) // 2]
            grown = exponent - median if exponent - median >= SCALE_JUMP else None
        recent.append(exponent)
        return grown
