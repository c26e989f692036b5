"""The two alerts that hold for minutes, ``CommlensLossScaleSkipping`` (5 min) and
``CommlensBusBandwidthDrop`` (10 min), fire end to end on a real job: seconds from the fault to each
firing. promtool's cases fire them on made-up series; the test suite does not wait that long.

An ordinary training script (``tests/faulty_train.py --amp``: 3 gloo ranks of one DDP group, float16
forward, dynamic loss scaling that skips a step now and then) under ``commlens run --in-process``, and
Debian's Prometheus (1 s scrape and evaluation) with the shipped rules. It trains healthy for a few
minutes (the hourly mean of the bus bandwidth); from step ``FAULT_STEP`` on, rank 1's gradients hold
Inf every step (``inf``: every rank's loss scaler skips every step) and rank 1 computes ``SLOW_MS``
longer every step (``slow``: the others wait for it in every all_reduce, their bus bandwidth falls to
a fraction). It polls Prometheus' ``ALERTS`` until both fire, and exits 1 if one has not by
``--deadline-s`` past the fault.

    python bench/slow_alerts.py [--deadline-s 1500]

About 17 minutes (16.5 measured on 2 busy cores): 2-4 min of healthy steps, the loss scaler's alert about
10 min after the fault (the skipped steps outnumber the applied ones in its 5 min window, then 5 min
``for``), the bandwidth's about 14 (once the healthy collectives leave its 5 min window, then 10 min
``for``). Not a test.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from monitoring import Prometheus, TrainingJob, wait_for  # noqa: E402

RULES = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "prometheus-rules.yaml"
ALERTS = ("CommlensLossScaleSkipping", "CommlensBusBandwidthDrop")
FAULT_STEP, SLOW_MS = 5000, 500
"""Healthy steps (~25-40 a second here) before the faults; rank 1's extra compute a step from then on."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deadline-s", type=float, default=1500, help="seconds past the fault for both to fire")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp, \
            TrainingJob(pathlib.Path(tmp), 3, "inf,slow", rank=1, step=FAULT_STEP, steps=FAULT_STEP + 5000,
                        extra=["--amp", "--slow-ms", str(SLOW_MS)], start_now=False) as job, \
            Prometheus(pathlib.Path(tmp), job, [RULES]) as prometheus:
        job.start()
        started = time.time()
        query = f'ALERTS{{alertname=~"{"|".join(ALERTS)}"}}'
        fault_at = wait_for(lambda: job.fault_at() or prometheus.query(query), "the fault", 900)
        if isinstance(fault_at, list):  # pending or firing on a healthy job
            print(f"failed: before the fault: {[s['metric'] for s in fault_at]}", file=sys.stderr)
            return 1
        print(f"fault at step {FAULT_STEP}, {fault_at - started:.0f} s into the job: rank 1's gradients Inf, "
              f"its steps {SLOW_MS:.0f} ms longer", flush=True)
        fired: dict[str, float] = {}
        while len(fired) < len(ALERTS) and time.time() < fault_at + args.deadline_s and job.process.poll() is None:
            try:
                states = prometheus.query(query.replace("}", ', alertstate="firing"}'))
            except OSError:
                states = []
            for alert in set(ALERTS) - set(fired):
                mine = [s["metric"] for s in states if s["metric"]["alertname"] == alert]
                if mine:
                    fired[alert] = time.time() - fault_at
                    ranks = sorted(m["rank"] for m in mine if "rank" in m)
                    print(f"{alert}: firing {fired[alert]:.0f} s after the fault"
                          + (f" (ranks {', '.join(ranks)})" if ranks else ""), flush=True)
            time.sleep(1)  # the polling period
        missing = [alert for alert in ALERTS if alert not in fired]
        if missing:
            why = "the job ended" if job.process.poll() is not None else f"{args.deadline_s:.0f} s past the fault"
            print(f"failed: {', '.join(missing)} not firing by {why}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
