"""``bench/rules_pinned.py`` finds every number and ``for`` of the rules' expressions, and none of their
prose: what it halves and doubles to see whether a promtool case notices."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))

from rules_pinned import changes  # noqa: E402

RULES = """      - alert: CommlensExample
        # a comment with 20 s and 0.5 in it
        expr: |
          rate(x_total[20s]) > 0.005 and on (job) count(y) >= 10
        for: 2s
        annotations:
          summary: "over 5 ms"
          description: >-
            Over the last 20 s it waited 2 times
            as long.
"""


def test_every_threshold_and_for_is_changed_both_ways_and_no_prose_or_range():
    found = [(index, what) for index, what, _ in changes(RULES.splitlines(keepends=True))]
    assert found == [(3, "0.005 -> 0.0025"), (3, "0.005 -> 0.01"), (3, "10 -> 5"), (3, "10 -> 20"),
                     (4, "for 2s -> 1s"), (4, "for 2s -> 4s")], found
