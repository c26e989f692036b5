"""Seconds from a fault to its verdict, for each fault the end-to-end tests inject.

Each run starts an ordinary training script with the fault written into it (``tests/faulty_train.py``,
3 gloo ranks) under ``commlens run -- torchrun``, and Debian's Prometheus (1 s scrape and evaluation)
with the shipped rules. From the wall time the script wrote when the fault happened, it measures:

* **named**: the first evaluation whose data names the culprit (its alert pending or firing);
* **firing**: the alert firing, and which ranks any culprit-naming alert named while firing (a false
  alert would add a rank other than the culprit; a culprit alert may be pending for one evaluation on
  another rank while the origin's scrape is not in yet, which is why the NaN rule waits 2 s).

Medians (and min – max) of ``--runs`` runs per fault. Goals: NaN origin ≤ 5 s; late or missing rank
≤ hang threshold (3 s here) + 5 s; straggler ≤ 20 s; no false alert on the other ranks.

    python bench/detection.py [--runs 3] [--faults nan,inf,late,leave,slow,desync]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from monitoring import Prometheus, TrainingJob, wait_for  # noqa: E402

RULES = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "prometheus-rules.yaml"
ALERTS = {"nan": "CommlensNaNOrigin", "inf": "CommlensNaNOrigin", "late": "CommlensRankLate",
          "leave": "CommlensRankLate", "slow": "CommlensStraggler", "desync": "CommlensCollectiveDesync"}
CULPRIT = 1
CULPRIT_ALERTS = set(ALERTS.values())


def measure(fault: str) -> tuple[float, float, set[str]]:
    """(seconds to named, seconds to firing, ranks any culprit alert named while firing) for one run."""
    alert = ALERTS[fault]
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp, TrainingJob(pathlib.Path(tmp), 3, fault, rank=CULPRIT) as job, \
            Prometheus(pathlib.Path(tmp), job.targets, [RULES]) as prometheus:
        named = firing = None
        ranks: set[str] = set()
        deadline = time.monotonic() + 120
        while firing is None and time.monotonic() < deadline:
            now = time.time()
            try:
                states = prometheus.query(f'ALERTS{{alertname=~"{"|".join(CULPRIT_ALERTS)}"}}')
            except OSError:
                states = []
            ranks |= {s["metric"].get("rank", "") for s in states if s["metric"]["alertstate"] == "firing"}
            mine = [s for s in states if s["metric"]["alertname"] == alert and s["metric"].get("rank") == str(CULPRIT)]
            if mine and named is None:
                named = now
            if any(s["metric"]["alertstate"] == "firing" for s in mine):
                firing = now
            time.sleep(0.2)  # the polling period of this measurement
        fault_at = wait_for(job.fault_at, "the fault's time", timeout_s=5)
    if firing is None:
        raise RuntimeError(f"{alert} never fired for the {fault} fault")
    return named - fault_at, firing - fault_at, ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--faults", default=",".join(ALERTS))
    args = parser.parse_args()
    print(f"{'fault':<8}{'alert':<28}{'named s (min-max)':>22}{'firing s (min-max)':>22}  ranks named by firing alerts")
    for fault in args.faults.split(","):
        runs = [measure(fault) for _ in range(args.runs)]
        named, firing = [r[0] for r in runs], [r[1] for r in runs]
        ranks = sorted(set().union(*(r[2] for r in runs)))
        print(f"{fault:<8}{ALERTS[fault]:<28}{_figure(named):>22}{_figure(firing):>22}  {ranks}", flush=True)


def _figure(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


if __name__ == "__main__":
    main()
