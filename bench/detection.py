"""Seconds from a fault to its verdict, and the verdicts' precision, for the faults the end-to-end tests
write into training scripts.

Each run starts an ordinary training script with the fault written into it under ``commlens run --
torchrun``, and Debian's Prometheus (1 s scrape and evaluation) with the shipped rules: 3 gloo ranks of
one DDP group (``tests/faulty_train.py``), or 4 ranks in tensor-parallel pairs, a pipeline of two stages
(``isend``/``irecv``), DDP and a global group at once (``tests/parallel_train.py``: the faults named
``tp-late``, ``late-send``, ``kill`` and ``size``; the last three with the pod sidecar), or 3 nodes of 2
ranks of the latter, each under its own ``commlens run`` with its pod sidecar (``node-kill``: every
process of node 1 SIGKILLed; ``node-cut``: its link down; ``node-throttle``: its CPU throttled to a tenth
of one; ``node-limit``: its link limited to 1 Mbit/s; root only, ``tests/nodes.py``). From the wall
time of the fault (the script writes it, or the harness notes it as it strikes), it measures:

* **named**: the first evaluation whose data names the culprit (its alert pending or firing);
* **firing**: the alert firing;
* **precision**: culprits named / ranks named, by every culprit-naming alert firing up to ``--after-s``
  (10) past the culprit's, and by ``commlens diagnose --prometheus`` once the alert fires (1.00: the
  culprit and nobody else); **recall**: the runs whose ``diagnose`` named the culprit.

Medians (and min – max) of ``--runs`` runs per fault; precision over all runs. Goals: NaN origin ≤ 5 s;
late or missing rank, a size mismatch and an unreachable node ≤ hang threshold (3 s here) + 5 s;
straggler ≤ 10 s; a slow node and a slow link ≤ 30 s; a kill ≤ 5 s; precision and recall 1.00.

    python bench/detection.py [--runs 3] [--faults nan,inf,late,leave,slow,desync,tp-late,late-send,kill,size,node-kill,node-cut,node-throttle,node-limit]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from monitoring import PARALLEL_SCRIPT, SCRIPT, Prometheus, TrainingJob, culprits, wait_for  # noqa: E402
from nodes import NodeJob, Nodes, why_not  # noqa: E402

RULES = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "prometheus-rules.yaml"
CULPRIT = 1
CULPRIT_NODE = "node-1"


@dataclasses.dataclass(frozen=True)
class Fault:
    alert: str
    """The alert that names the culprit."""
    script: str = SCRIPT
    world: int = 3
    job: dict = dataclasses.field(default_factory=dict)
    """``TrainingJob``'s options: where the fault is, its length, the pod sidecar."""


PARALLEL = {"script": PARALLEL_SCRIPT, "world": 4}
FAULTS = {
    "nan": Fault("CommlensNaNOrigin"),
    "inf": Fault("CommlensNaNOrigin"),
    "late": Fault("CommlensRankLate"),
    "leave": Fault("CommlensRankLate"),
    "slow": Fault("CommlensStraggler"),
    "desync": Fault("CommlensCollectiveDesync"),
    "tp-late": Fault("CommlensRankLate", **PARALLEL, job={"fault": "late", "step": 30, "extra": ["--late-s", "15"]}),
    "late-send": Fault("CommlensPeerLate", **PARALLEL, job={"step": 30, "extra": ["--late-s", "15"], "pod": True}),
    "kill": Fault("CommlensRankKilled", **PARALLEL, job={"step": 30, "pod": True}),
    "size": Fault("CommlensCollectiveMismatch", **PARALLEL, job={"step": 30, "pod": True, "extra": ["--timeout-s", "20"]}),
    "node-kill": Fault("CommlensNodeUnreachable", PARALLEL_SCRIPT, 6),
    "node-cut": Fault("CommlensNodeUnreachable", PARALLEL_SCRIPT, 6),
    "node-throttle": Fault("CommlensNodeSlow", PARALLEL_SCRIPT, 6),
    "node-limit": Fault("CommlensNetworkSlow", PARALLEL_SCRIPT, 6),
}
"""``node-*``: 3 nodes of 2 ranks (``tests/nodes.py``, root only), node 1 killed whole, its link cut, its
CPU throttled to a tenth of one, or its link limited to 1 Mbit/s (the culprit: the network)."""
CULPRIT_ALERTS = {fault.alert for fault in FAULTS.values()} | {"CommlensDeadlock", "CommlensCollectiveHung"}


@dataclasses.dataclass
class Run:
    named_s: float
    firing_s: float
    by_alerts: set[str]
    """Ranks (and nodes) that any culprit-naming alert named while firing."""
    by_diagnose: set[str]
    """Ranks (and nodes) that ``commlens diagnose --prometheus`` named once the alert fired."""


@contextlib.contextmanager
def _nodes_job(tmp: pathlib.Path, name: str):
    """3 nodes of 2 ranks; node 1 killed, cut off, throttled or its link limited once the job runs."""
    with Nodes(3) as nodes:
        job = NodeJob(nodes, tmp / "job", PARALLEL_SCRIPT, ["--steps", "3000", "--step-ms", "20", "--timeout-s", "30"])
        with Prometheus(tmp, job, [RULES]) as prometheus:
            wait_for(lambda: prometheus.query('commlens_collective_last_seq{pg="0", state="completed"} > 2'),
                     "the job under way on every node")
            fault_at = time.time()
            {"node-kill": nodes.kill, "node-cut": nodes.cut, "node-throttle": lambda k: nodes.throttle(k, 0.1),
             "node-limit": lambda k: nodes.limit(k, "1mbit")}[name](1)
            yield prometheus, lambda: fault_at


@contextlib.contextmanager
def _rank_job(tmp: pathlib.Path, name: str):
    fault = FAULTS[name]
    options = {"steps": 1000, **fault.job}
    written = options.pop("fault", name)  # the fault's name in the script
    with TrainingJob(tmp, fault.world, written, rank=CULPRIT, script=fault.script, **options) as job, \
            Prometheus(tmp, job, [RULES]) as prometheus:
        yield prometheus, job.fault_at


def _named(labels: dict) -> str:
    if labels["alertname"] == "CommlensNetworkSlow":
        return "network"
    return labels.get("node") if labels["alertname"] in ("CommlensNodeUnreachable", "CommlensNodeSlow") \
        else labels.get("rank", "")


def _culprit(name: str) -> str:
    return "network" if name == "node-limit" else CULPRIT_NODE if name.startswith("node-") else str(CULPRIT)


def measure(name: str, after_s: float) -> Run:
    fault, culprit = FAULTS[name], _culprit(name)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp, \
            (_nodes_job if name.startswith("node-") else _rank_job)(pathlib.Path(tmp), name) as (prometheus, fault_at):
        named = firing = diagnose = None
        ranks: set[str] = set()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            now = time.time()
            try:
                states = prometheus.query(f'ALERTS{{alertname=~"{"|".join(CULPRIT_ALERTS)}"}}')
            except OSError:
                states = []
            ranks |= {_named(s["metric"]) for s in states if s["metric"]["alertstate"] == "firing"} - {""}
            mine = [s for s in states if s["metric"]["alertname"] == fault.alert and _named(s["metric"]) == culprit]
            if mine and named is None:
                named = now
            if firing is None and any(s["metric"]["alertstate"] == "firing" for s in mine):
                firing = now
                diagnose = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", "--prometheus",
                                           f"http://127.0.0.1:{prometheus.port}"], capture_output=True, text=True,
                                          timeout=60)
                deadline = time.monotonic() + after_s  # any other alert firing meanwhile is a false one
            time.sleep(0.2)  # the polling period of this measurement
        if firing is None:
            raise RuntimeError(f"{fault.alert} never fired for the {name} fault")
        if diagnose.returncode != 1:  # 1: something wrong found
            raise RuntimeError(f"commlens diagnose failed for the {name} fault: {diagnose.stdout}{diagnose.stderr}")
        fault_at = wait_for(fault_at, "the fault's time", timeout_s=5)
    said = {str(rank) for rank in culprits(diagnose.stdout)} | set(re.findall(r"(?:unreachable|slow node): node (\S+)",
                                                                              diagnose.stdout))
    said |= {"network"} if "the network is slow" in diagnose.stdout else set()
    return Run(named - fault_at, firing - fault_at, ranks, said)


def precision(named: list[set[str]], culprit: str) -> str:
    """Culprits named / ranks (and nodes) named, over all runs."""
    ranks = sum(len(r) for r in named)
    return f"{sum(culprit in r for r in named) / ranks:.2f}" if ranks else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--after-s", type=float, default=10.0,
                        help="seconds to watch for other alerts once the culprit's fires")
    args = parser.parse_args()
    print(f"{'fault':<10}{'alert':<26}{'named s (min-max)':>20}{'firing s (min-max)':>20}"
          f"{'precision: alerts':>19}{'diagnose':>10}{'recall':>8}  ranks named by alerts; by diagnose")
    for name in args.faults.split(","):
        if name.startswith("node-") and why_not() is not None:
            print(f"{name:<10}skipped: {why_not()}", flush=True)
            continue
        runs = [measure(name, args.after_s) for _ in range(args.runs)]
        culprit = _culprit(name)
        by_alerts, by_diagnose = [r.by_alerts for r in runs], [r.by_diagnose for r in runs]
        print(f"{name:<10}{FAULTS[name].alert:<26}{_figure([r.named_s for r in runs]):>20}"
              f"{_figure([r.firing_s for r in runs]):>20}{precision(by_alerts, culprit):>19}"
              f"{precision(by_diagnose, culprit):>10}{sum(culprit in r for r in by_diagnose) / len(runs):>8.2f}  "
              f"{sorted(set().union(*by_alerts))}; {sorted(set().union(*by_diagnose))}", flush=True)


def _figure(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


if __name__ == "__main__":
    main()
