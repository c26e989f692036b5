"""Seconds from the first scrape that shows a fault to its culprit's alert firing, at each scrape
interval: promtool replays each fault of ``tests/test_scrape_intervals.py`` (its series, scraped that
often) under the shipped rules, as written at 2 s or less and as ``commlens assets --scrape-interval``
renders them above; the first evaluation at which the alert names the culprit. The table of
docs/verdicts.md ("At the scrape interval Prometheus runs at").

    python bench/fire_times.py     # about a minute
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_scrape_intervals as replays  # noqa: E402

from commlens.agent.verdicts.rule_files import WRITTEN_FOR_S, at_interval  # noqa: E402

INTERVALS_S = (1, 2, 5, 15, 30, 60)
FAULTS = {"straggler": "straggler", "late": "late rank (3 s threshold)", "nan": "NaN origin", "peer-late": "peer late",
          "killed": "killed (pod sidecar)"}
"""The replays' faults, and their columns."""


def fires(folder: pathlib.Path, interval_s: int, fault: str, at_s: int) -> bool:
    """Whether ``fault``'s alert names its culprit at ``at_s`` seconds (the rules in ``folder``)."""
    _, alert, rank, _ = replays.FAULTS[fault]
    expr = f'count(ALERTS{{alertstate="firing", alertname="{alert}", rank="{rank}"}})'
    return replays.replay(folder, fault, interval_s, expr, at_s, [{"value": 1}]).returncode == 0


def main() -> int:
    rules = replays.RULES.read_text()
    print("| scrape interval | " + " | ".join(FAULTS.values()) + " |")
    print("| --- |" + " --- |" * len(FAULTS))
    missing = 0
    for interval in INTERVALS_S:
        with tempfile.TemporaryDirectory() as tmp:
            folder = pathlib.Path(tmp)
            (folder / "rules.yaml").write_text(rules if interval <= WRITTEN_FOR_S else at_interval(rules, interval))
            cells = []
            for fault in FAULTS:
                start, limit = replays.FAULT_AT * interval, replays.THRESHOLD_S + 8 * interval
                found = next((after for after in range(0, limit + 1, interval)
                              if fires(folder, interval, fault, start + after)), None)
                missing += found is None
                cells.append("-" if found is None else str(found))
        label = f"{interval} s" + (" (as written)" if interval <= WRITTEN_FOR_S else "")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
