"""The rules' numbers pinned: ``bench/rules_pinned.py`` finds every number and ``for`` of the rules'
expressions, and none of their prose (what it halves and doubles to see whether a promtool case
notices); the culprit alerts' ``for`` hold them back exactly that long."""

import pathlib
import re
import sys

import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))

from monitoring import promtool  # noqa: E402
from rules_pinned import changes  # noqa: E402
from test_scrape_intervals import FAULTS, RULES, SCRAPES  # noqa: E402

pytestmark = pytest.mark.torch_free  # no torch code: .ci/run runs it under one torch version

EXAMPLE = """      - alert: CommlensExample
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
    found = [(index, what) for index, what, _ in changes(EXAMPLE.splitlines(keepends=True))]
    assert found == [(3, "0.005 -> 0.0025"), (3, "0.005 -> 0.01"), (3, "10 -> 5"), (3, "10 -> 20"),
                     (4, "for 2s -> 1s"), (4, "for 2s -> 4s")], found


@pytest.mark.parametrize("fault, hold_s", [("nan", 2), ("late", 2), ("peer-late", 2), ("straggler", 2)])
def test_an_alerts_for_holds_it_back_as_long_as_it_should(tmp_path, fault, hold_s):
    """The culprit's alert of each replayed fault (``test_scrape_intervals``, scraped every second) fires
    ``hold_s`` after the rules with no ``for`` would (a second more where its condition first holds for
    one evaluation only): halve or double a ``for`` and this fails. NaN origin's 2 s let every rank be
    scraped once before a rank reached first is named; a straggler's 2 s, two windows agreeing."""
    make, alert, rank, _ = FAULTS[fault]
    rules = RULES.read_text()
    at_once = re.sub(rf"(- alert: {alert}\n(?:.*\n)*?\s+for: )\d+s\n", r"\g<1>0s\n", rules)
    held = _first_firing(tmp_path, rules, make, alert, rank) - _first_firing(tmp_path, at_once, make, alert, rank)
    assert hold_s <= held <= hold_s + 1, held


def _first_firing(tmp_path, rules: str, make, alert: str, rank: str) -> int:
    """The first second at which ``alert`` fires naming ``rank`` on ``make``'s series under ``rules``: one
    promtool run that expects it silent every second, and lists when it is not."""
    firing = f'ALERTS{{alertname="{alert}", alertstate="firing", rank="{rank}"}}'
    # the groups in one order at every evaluation, as they are written (promtool's own varies between
    # evaluations: a record read from another group may be one evaluation old, and the hold one shorter)
    order = re.findall(r"^  - name: (\S+)$", rules, re.MULTILINE)
    document = {"rule_files": ["rules.yaml"], "evaluation_interval": "1s", "group_eval_order": order, "tests": [{
        "interval": "1s", "input_series": make(1),
        "promql_expr_test": [{"expr": firing, "eval_time": f"{t}s", "exp_samples": []} for t in range(SCRAPES)]}]}
    (tmp_path / "rules.yaml").write_text(rules)
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(document))
    found = promtool("test", "rules", "test.yaml", cwd=tmp_path)
    times = [int(t) for t in re.findall(r"time: (\d+)s", found.stdout + found.stderr)]
    assert times, found.stdout + found.stderr
    return min(times)
