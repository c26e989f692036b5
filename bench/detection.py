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

``--matrix``: the verdict matrix instead, on ``tests/matrix_train.py`` (an ordinary training script in
five layouts: ``ddp``, ``fsdp``, ``tp-dp``, ``tp-pp-dp``, ``pp4``), one job per cell, a cell being layout x fault
x exporter (``per-rank``: ``commlens run --in-process``; ``pod``: ``commlens run --sidecar``) x the
culprit's position (first or last pipeline stage, either TP member, either replica, rank 0; drawn with
``--seed`` unless the cell names it). Each cell scores three readers: the alerts that name a rank
(precision: culprit named / ranks named; recall: culprit named), ``commlens diagnose --prometheus``
live once the fault's alert fires, and ``commlens diagnose`` on the job's folder after the job; and the
seconds from the fault to its alert firing. ``run_cell(tmp_path, cell)`` does one (``tests`` may call
it).

    python bench/detection.py --matrix [--layouts ddp,fsdp,tp-dp,tp-pp-dp,pp4] [--faults nan,kill,...]
        [--modes per-rank,pod] [--seed 0] [--precision fp32] [--json results.json]
    python bench/detection.py --matrix --cells tp-pp-dp:nan:pod:6,ddp:leave:per-rank:2:w4,tp-pp-dp:none:pod:0:bf16

A cell is ``layout:fault:mode[:culprit][:precision][:wWORLD]``; a culprit of ``*`` or none is drawn.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from monitoring import (MATRIX_SCRIPT, PARALLEL_SCRIPT, SCRIPT, Prometheus, TrainingJob, culprits,  # noqa: E402
                        end_session, wait_for, wait_training)
from nodes import NodeJob, Nodes, why_not  # noqa: E402

from commlens.agent.verdicts.catalogue import VERDICT_ALERTS  # noqa: E402

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
                states = prometheus.query(f'ALERTS{{alertname=~"{"|".join(VERDICT_ALERTS)}"}}')
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
    if "--matrix" in sys.argv[1:]:
        return matrix_main([arg for arg in sys.argv[1:] if arg != "--matrix"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--matrix", action="store_true", help="the verdict matrix instead (see --matrix --help)")
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


# The verdict matrix (--matrix) -----------------------------------------------------------------------

from matrix_train import SHAPES  # noqa: E402

FAULT_STEP = 20
"""The step the fault strikes at; ``size`` and ``desync`` in the job's loss all_reduce of that step."""
JUDGED_AFTER_S = 30
"""A slowness fault strikes this many seconds of steps later: once the rules judge every rank (10 s
from its first scrape, its windows full) and have its healthy share of time in collectives to compare."""
EXPECTED = {"nan": ("CommlensNaNOrigin",), "inf": ("CommlensNaNOrigin",),
            "late": ("CommlensRankLate", "CommlensPeerLate"), "leave": ("CommlensRankLate", "CommlensPeerLate"),
            "kill": ("CommlensRankKilled",), "size": ("CommlensCollectiveMismatch",),
            "desync": ("CommlensCollectiveDesync",), "slow-data": ("CommlensStraggler",),
            "slow-compute": ("CommlensStraggler",), "corrupt": ("CommlensReplicaMismatch",),
            "grow": ("CommlensInputDiverging",), "flip": ("CommlensInputDiverging",), "stall": (), "none": ()}
"""The alert(s) that name the culprit of each fault; none live for a one-off stall (named after the fact)."""
TRAINS_ON_S = {"none": 30, "stall": 25, "nan": 30, "inf": 30, "late": 30, "slow-data": 50, "slow-compute": 50,
               "corrupt": 30, "grow": 30, "flip": 30}
"""Seconds the job trains after the fault (after its start, healthy); the other faults end the job."""
MODEL_PARAMS = {"flip": "bf16"}
"""The model's dtype for a fault, in fp32 cells (``matrix_train.py --params``): a value flipped high in a
bfloat16 gradient (autocast's cells keep float32 gradients)."""
LATE_S = 20
"""A late rank's sleep: its alert fires (hang threshold 3 s, ``for`` 2 s) and the live diagnose reads it before
it catches up."""
BACKEND_TIMEOUT_S = {"size": 20, "desync": 20}
"""The backend's timeout, which ends a job hung by these faults (60 s for the others)."""
MODES = {"per-rank": False, "pod": True}


@dataclasses.dataclass(frozen=True)
class Layout:
    world: int
    step_ms: float
    """Base compute per step: large enough that the job keeps up on 2 cores under commlens."""
    step_s: float
    """A step's wall time under commlens on this machine (measured): how many steps last how long."""


LAYOUTS = {"ddp": Layout(3, 20, 0.025), "fsdp": Layout(4, 20, 0.036), "tp-dp": Layout(4, 30, 0.04),
           "tp-pp-dp": Layout(8, 60, 0.12), "pp4": Layout(4, 40, 0.12)}
"""Steps measured from the spans of 150-300 healthy steps under ``commlens run`` (2026-11-28, 2 cores):
ddp 24 ms, fsdp 36 ms, tp-dp 37 ms, tp-pp-dp 113 ms (the 1F1B schedule's bubble: 3 slots of 2 microbatches),
pp4 115 ms."""


def positions(layout: str, world: int) -> dict[int, str]:
    """The culprit positions of ``layout``: rank -> where it is. Together they cover the first and the
    last pipeline stage, either TP member, either replica, rank 0."""
    tp, stages, per_replica = SHAPES[layout]
    per_replica = per_replica or 1
    replicas = world // per_replica

    def at(r: int, s: int, t: int) -> int:
        return r * per_replica + s * tp + t

    if stages == 1:
        ranks = set(range(world))
    elif tp > 1:
        ranks = {at(0, 0, 0), at(0, stages - 1, tp - 1), at(replicas - 1, 0, tp - 1), at(replicas - 1, stages - 1, 0)}
    else:
        ranks = {at(s % replicas, s, 0) for s in range(stages)}
    return {rank: where(layout, rank) for rank in sorted(ranks)}


def where(layout: str, rank: int) -> str:
    """Where ``rank`` is in ``layout``: its stage, TP index and replica."""
    tp, stages, per_replica = SHAPES[layout]
    per_replica = per_replica or 1
    parts = [f"replica {rank // per_replica}"]
    if tp > 1:
        parts.insert(0, f"TP {rank % tp}")
    if stages > 1:
        stage = rank % per_replica // tp
        parts.insert(0, "first stage" if stage == 0 else "last stage" if stage == stages - 1 else f"stage {stage}")
    return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Cell:
    layout: str
    fault: str
    mode: str
    culprit: int | None
    """None for a healthy cell."""
    precision: str = "fp32"
    world: int = 0
    """0: the layout's."""

    @property
    def ranks(self) -> int:
        return self.world or LAYOUTS[self.layout].world

    def __str__(self) -> str:
        return ":".join([self.layout, self.fault, self.mode, "-" if self.culprit is None else str(self.culprit)]
                        + ([self.precision] if self.precision != "fp32" else [])
                        + ([f"w{self.world}"] if self.world and self.world != LAYOUTS[self.layout].world else []))

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> Cell:
        """``layout:fault:mode[:culprit][:precision][:wWORLD]``; a culprit of ``*`` or none is drawn."""
        layout, fault, mode, *rest = text.split(":")
        if layout not in LAYOUTS or fault not in EXPECTED or mode not in MODES:
            raise ValueError(f"{text!r}: give layout ({', '.join(LAYOUTS)}):fault ({', '.join(EXPECTED)}):mode "
                             f"({', '.join(MODES)})[:culprit][:fp32|bf16|fp16][:wWORLD]")
        culprit, precision, world = "*", "fp32", 0
        for part in rest:
            if part in ("fp32", "bf16", "fp16"):
                precision = part
            elif part.startswith("w") and part[1:].isdigit():
                world = int(part[1:])
            else:
                culprit = part
        ranks = world or LAYOUTS[layout].world
        if culprit not in ("*", "-") and not (culprit.isdigit() and int(culprit) < ranks):
            raise ValueError(f"{text!r}: culprit {culprit!r} is not a rank of the job: give 0 to {ranks - 1}, "
                             "or * to draw one")
        return cls.make(layout, fault, mode, precision, world, seed, None if culprit in ("*", "-") else int(culprit))

    @classmethod
    def make(cls, layout: str, fault: str, mode: str, precision: str = "fp32", world: int = 0, seed: int = 0,
             culprit: int | None = None) -> Cell:
        if fault == "none":
            culprit = None
        elif culprit is None:
            where = positions(layout, world or LAYOUTS[layout].world)
            culprit = random.Random(f"{seed}:{layout}:{fault}:{mode}:{precision}").choice(sorted(where))
        return cls(layout, fault, mode, culprit, precision, world)


REPLICA_FAULTS = {"corrupt": ("ddp",), "grow": ("ddp",), "flip": ("ddp",)}
"""The layouts whose data-parallel groups hold three replicas or more, where a fault of one replica's
data is named alone (of two that differ, which one is wrong is not known: both are named); ``grow``
and ``flip`` also need DDP's buckets, whose scale commlens follows (matrix_train.py)."""


def judged_in(layout: str, fault: str) -> bool:
    """Whether the matrix has the cell of ``fault`` in ``layout``."""
    return layout in REPLICA_FAULTS.get(fault, (layout,))


@dataclasses.dataclass
class CellResult:
    cell: Cell
    wall_s: float
    fired_s: float | None
    """Seconds from the fault to the expected alert firing for the culprit (None: it did not)."""
    by_alerts: set[str]
    by_live: set[str]
    by_offline: set[str]
    alerts: list[str]
    """Every alert that fired during the cell: name, labels, seconds after the fault (or the job's start)."""
    live: str
    offline: str
    live_at_end: str
    """``diagnose --prometheus`` as the job ended, where it ended before the expected alert fired."""
    job_rc: int | None
    ended_by: str
    """"itself", or "harness" where the cell ended the job."""

    SOURCES = ("alerts", "live", "offline")

    def named(self, source: str) -> set[str]:
        return {"alerts": self.by_alerts, "live": self.by_live, "offline": self.by_offline}[source]

    def score(self, source: str) -> tuple[float | None, float | None]:
        """(precision, recall) of ``source``: culprit named / ranks named (None where none was named), and
        culprit named (None for a healthy cell)."""
        named, culprit = self.named(source), self.cell.culprit
        if culprit is None:
            return None, None
        hit = str(culprit) in named
        return (hit / len(named) if named else None), float(hit)

    def required(self, source: str) -> bool:
        """Whether ``source`` must name the culprit (a one-off stall: after the fact only)."""
        return self.cell.fault != "stall" or source == "offline"

    @property
    def ok(self) -> bool:
        if self.cell.culprit is None:
            return not any(self.named(source) for source in self.SOURCES)
        for source in self.SOURCES:
            precision, recall = self.score(source)
            if (precision is not None and precision < 1) or (self.required(source) and recall != 1):
                return False
        return not EXPECTED[self.cell.fault] or self.fired_s is not None


def _diagnose(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", *args], capture_output=True,
                          text=True, timeout=120)
    return done.stdout + done.stderr


def _ranks_said(report: str) -> set[str]:
    return {str(rank) for rank in culprits(report)} | set(re.findall(r"(?:unreachable|slow node): node (\S+)", report))


def run_cell(tmp_path: pathlib.Path, cell: Cell, alert_timeout_s: float = 90, after_end_s: float = 30,
             after_s: float = 5, trains_on_s: float | None = None, script_args: tuple[str, ...] = ()) -> CellResult:
    """One cell: Prometheus with the shipped rules, then the job; the expected alert awaited (up to
    ``alert_timeout_s`` past the job's start-up, or ``after_end_s`` past the job's end); ``diagnose
    --prometheus`` at once; the job let end (ended past its time); every alert that fired until then, and
    at least ``after_s`` past the expected one; ``diagnose`` on the job's folder. ``trains_on_s``: in place of ``TRAINS_ON_S``'s;
    ``script_args``: more of ``matrix_train.py``'s arguments."""
    started = time.monotonic()
    layout, fault = LAYOUTS[cell.layout], cell.fault
    trains_on = trains_on_s or TRAINS_ON_S.get(fault)
    slowed_s = 0.06 if fault.startswith("slow") else 0  # the slow rank's --slow-ms: every step waits for it
    fault_step = FAULT_STEP + (math.ceil(JUDGED_AFTER_S / layout.step_s) if fault.startswith("slow") else 0)
    steps = fault_step + int(trains_on / (layout.step_s + slowed_s)) if trains_on else 100_000
    if fault == "none":
        steps = int(trains_on / layout.step_s)
    extra = ["--layout", cell.layout, "--precision", cell.precision, "--step-ms", str(layout.step_ms),
             "--late-s", str(LATE_S), "--timeout-s", str(BACKEND_TIMEOUT_S.get(fault, 60)), *script_args]
    if cell.precision == "fp32" and fault in MODEL_PARAMS:
        extra += ["--params", MODEL_PARAMS[fault]]
    # a straggler's verdict needs no hang threshold: at 3 s a stall of this 2-core machine makes ranks
    # wait past it (as tests/test_verdicts.py's slow rank)
    hang_threshold_s = 60 if fault.startswith("slow") else 3
    culprit = "" if cell.culprit is None else str(cell.culprit)
    expected = EXPECTED[fault]
    with TrainingJob(tmp_path, cell.ranks, fault, rank=cell.culprit or 0, step=fault_step, steps=steps,
                     hang_threshold_s=hang_threshold_s, extra=extra, pod=MODES[cell.mode], script=MATRIX_SCRIPT,
                     start_now=False) as job, Prometheus(tmp_path, job, [RULES]) as prometheus:
        wait_for(lambda: len(prometheus.query("up")) == len(job.targets), "Prometheus' first scrapes")
        job_started = time.time()
        job.start()
        wait_training(prometheus, job)  # the timeouts below time what follows the start-up, not the start-up
        ended_at = None

        def ended() -> bool:
            nonlocal ended_at
            if ended_at is None and job.process.poll() is not None:
                ended_at = time.monotonic()
            return ended_at is not None

        def fired() -> bool:
            selector = f'ALERTS{{alertstate="firing",alertname=~"{"|".join(expected)}"}}'
            return any(a["metric"].get("rank") == culprit for a in prometheus.query(selector))

        def live_point() -> bool:  # healthy or stalled: once Prometheus holds 15 s of training (and the stall)
            return bool(prometheus.query("commlens_collective_duration_seconds_count offset 15s")) and (
                fault == "none" or (job.fault_at() is not None and time.time() > job.fault_at() + 5))

        waiting_for = fired if expected else live_point
        deadline = time.monotonic() + alert_timeout_s + (40 if fault == "none" else 0)
        at_end = ""  # where the job ends first: diagnose --prometheus then too, as evidence
        while time.monotonic() < deadline and not (ended() and time.monotonic() > ended_at + after_end_s):
            try:
                if waiting_for():
                    break
            except OSError:
                pass
            if ended() and not at_end:
                at_end = _diagnose("--prometheus", f"http://127.0.0.1:{prometheus.port}")
            time.sleep(0.25)  # the polling period
        watched_until = time.monotonic() + after_s  # any other alert firing meanwhile is a false one
        live = _diagnose("--prometheus", f"http://127.0.0.1:{prometheus.port}")
        ended_by = "itself"
        try:
            job.wait(max(60, (steps - fault_step) * layout.step_s * 3) if trains_on else 120)
        except subprocess.TimeoutExpired:
            ended_by = "harness"
            end_session(job.process, 30)
        while time.monotonic() < watched_until:
            time.sleep(0.25)  # not synchronisation: the alerts are watched this long
        # the raw samples of every alert that fired (a subquery's steps would miss one of the last second)
        alerts = prometheus.query(f'ALERTS{{alertstate="firing"}}[{int(time.time() - job_started) + 2}s]')
        job_rc = job.process.returncode
    offline = _diagnose(str(job.out))
    zero = job.fault_at() or job_started
    by_alerts = {_named(a["metric"]) for a in alerts if a["metric"]["alertname"] in VERDICT_ALERTS} - {""}
    first = {id(a): min(float(t) for t, _ in a["values"]) for a in alerts}
    mine = [first[id(a)] for a in alerts if a["metric"]["alertname"] in expected and a["metric"].get("rank") == culprit]
    said = []
    for a in sorted(alerts, key=lambda a: first[id(a)]):
        labels = {k: v for k, v in a["metric"].items() if k in ("rank", "node", "pg", "op", "peer", "waiter")}
        said.append(f"{a['metric']['alertname']}{labels} at {first[id(a)] - zero:+.1f} s")
    return CellResult(cell, time.monotonic() - started, min(mine) - zero if mine and job.fault_at() else None,
                      by_alerts, _ranks_said(live), _ranks_said(offline), said, live, offline, at_end, job_rc, ended_by)


def _pr(result: CellResult, source: str) -> str:
    precision, recall = result.score(source)
    if result.cell.culprit is None:
        return "ok" if not result.named(source) else "FP"
    return f"{'-' if precision is None else f'{precision:.2f}'}/{recall:.0f}"


def _set(named: set[str]) -> str:
    return "{" + ",".join(sorted(named, key=lambda n: (len(n), n))) + "}"


def matrix_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="The verdict matrix: layout x fault x exporter x culprit position")
    parser.add_argument("--cells", help="comma-separated layout:fault:mode[:culprit][:precision][:wWORLD]")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--faults", default=",".join(EXPECTED))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every cell's result here")
    parser.add_argument("--keep", help="keep each cell's folder (its job's files, logs) under this folder")
    args = parser.parse_args(argv)
    try:
        cells = [Cell.parse(text, args.seed) for text in args.cells.split(",")] if args.cells else []
    except ValueError as error:
        parser.error(str(error))
    cells = cells or [
        Cell.make(layout, fault, mode, args.precision, seed=args.seed) for layout in args.layouts.split(",")
        for fault in args.faults.split(",") for mode in args.modes.split(",") if judged_in(layout, fault)]
    header = (f"{'cell':<34}{'P/R alerts':>11}{'P/R live':>10}{'P/R offline':>12}{'fire s':>8}{'wall s':>8}  ok    "
              f"named by alerts; by live diagnose; by offline diagnose   (culprit's position)")
    print(header, flush=True)
    results = []
    for cell in cells:
        if args.keep:
            folder = pathlib.Path(args.keep) / str(cell).replace(":", "_")
            folder.mkdir(parents=True)
            result = run_cell(folder, cell)
        else:
            with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
                result = run_cell(pathlib.Path(tmp), cell)
        results.append(result)
        place = "" if cell.culprit is None else where(cell.layout, cell.culprit)
        print(f"{str(cell):<34}{_pr(result, 'alerts'):>11}{_pr(result, 'live'):>10}{_pr(result, 'offline'):>12}"
              f"{'-' if result.fired_s is None else f'{result.fired_s:.1f}':>8}{result.wall_s:>8.0f}  "
              f"{'ok  ' if result.ok else 'FAIL'}  {_set(result.by_alerts)}; {_set(result.by_live)}; "
              f"{_set(result.by_offline)}" + (f"   ({place})" if place else ""), flush=True)
    for result in results:
        if not result.ok:
            print(f"\n== {result.cell} (culprit {result.cell.culprit}; expected "
                  f"{'/'.join(EXPECTED[result.cell.fault]) or 'no alert'}; job exit {result.job_rc}, "
                  f"ended by {result.ended_by})\nalerts fired: {'; '.join(result.alerts) or 'none'}\n"
                  f"-- diagnose --prometheus (live):\n{result.live.rstrip()}\n"
                  + (f"-- diagnose --prometheus as the job ended, before any expected alert:\n"
                     f"{result.live_at_end.rstrip()}\n" if result.live_at_end else "") +
                  f"-- diagnose <folder> (after the job):\n{result.offline.rstrip()}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps([{
            **dataclasses.asdict(r), "cell": str(r.cell), "culprit": r.cell.culprit, "ok": r.ok,
            "by_alerts": sorted(r.by_alerts), "by_live": sorted(r.by_live), "by_offline": sorted(r.by_offline),
            "scores": {s: r.score(s) for s in CellResult.SOURCES}} for r in results], indent=1))


if __name__ == "__main__":
    main()
