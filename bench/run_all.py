"""Every figure the docs state, measured by one command: each bench below runs in turn at HEAD, its
output kept whole in ``bench/results/<name>.txt`` under a header (date, commit, machine, command, run
time), and ``docs/figures.md`` written from those files: the goals, each read from its bench's output
and judged met or missed on that run (medians, the default configuration), then each bench's output.

    python bench/run_all.py                          # every bench: about 2 hours on 2 cores
    python bench/run_all.py --only hook_overhead,nan_check
    python bench/run_all.py --render                 # docs/figures.md from the stored results alone

The GPU's figures come from a device (``bench/gpu_checks.sh``, docs/gpu.md; its runs kept in
``bench/results/gpu.txt``), not from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import platform
import re
import subprocess
import sys
import time
from typing import Callable

from commlens.agent.verdicts.catalogue import VERDICT_ALERTS

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FIGURES = ROOT / "docs" / "figures.md"


@dataclasses.dataclass(frozen=True)
class Bench:
    name: str
    argv: tuple[str, ...]
    what: str


BENCHES = (
    Bench("hook_overhead", ("bench/hook_overhead.py",), "the hot path alone, a backend that returns at once"),
    Bench("export_throughput", ("bench/export_throughput.py",), "the sidecar's drain, span building, the trace file"),
    Bench("nan_check", ("bench/nan_check.py",), "the NaN/Inf check against one torch.sum of the payload"),
    Bench("fingerprints", ("bench/fingerprints.py",),
          "one fingerprint against one torch.sum; a DDP step's share at each sampling"),
    Bench("agent_cost", ("bench/agent_cost.py", "--repeats", "5"),
          "the whole agent, each configuration against no commlens: fresh 2-rank jobs, and CPU on one rank"),
    Bench("latency_loop", ("bench/latency_loop.py",), "2 ranks, configurations switched in place: rank 0 by thread"),
    Bench("step_cost", ("bench/step_cost.py",), "a DDP step of 2 ranks, each configuration paired with none"),
    Bench("memory_flat", ("bench/memory_flat.py",), "1,000,000 collectives of 1,000 shapes in 100 groups"),
    Bench("scale", ("bench/scale.py",), "one Prometheus holding 1,000 and 10,000 ranks' series, the rules on them"),
    Bench("victoria", ("bench/victoria.py",), "the same jobs on two sharded vmagents, VictoriaMetrics and vmalert"),
    Bench("shards", ("bench/shards.py",), "the same jobs on three Prometheus servers, sharded by job (hashmod)"),
    Bench("fire_times", ("bench/fire_times.py",),
          "seconds from a fault's first scrape to its culprit's alert at each scrape interval, promtool's replays"),
    Bench("replica_soak", ("bench/replica_soak.py",),
          "healthy DDP jobs, 10 minutes each in fp32, bf16, fp16 and a bfloat16 model, watched for a false alarm"),
    Bench("detection", ("bench/detection.py", "--matrix", "--seed", "9"),
          "the verdict matrix: every layout and fault, both modes, culprits drawn"),
)


def _number(pattern: str) -> Callable[[str], float]:
    return lambda out: float(re.search(pattern, out, re.M).group(1).replace(",", ""))


def _nan_check_worst(table: int) -> Callable[[str], float]:
    """The largest ratio of the ``table``-th table: the check over a sum; the non-finite path over the finite."""
    def read(out: str) -> float:
        rows = out.strip().split("\n\n")[table].splitlines()[1:]
        return max(float(re.search(r"([\d.]+)x", row).group(1)) for row in rows)
    return read


def _two_ranks_cpu(out: str) -> float:
    row = next(line for line in out.splitlines() if line.startswith("agent "))
    numbers = [float(n) for n in re.findall(r"-?\d+\.\d+", row)]
    return numbers[3] + numbers[12]  # the training thread's CPU over none, and commlens' threads', medians


def _rss_growth(out: str) -> float:
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*[\d,]+\s+\d+\s+\d+\s", line)]
    return float(rows[-1][1]) / float(rows[0][1])


def _all_right(size: str) -> Callable[[str], float]:
    """1 where, at that size, every alert named its fault's culprit alone and no other verdict's alert fired
    (a health alert may: a node gone is a target down)."""
    def read(out: str) -> float:
        part = out.split(size)[1]
        also = re.findall(r"also firing: (\w+)", part)
        return float("WRONG" not in part and not set(also) & set(VERDICT_ALERTS))
    return read


def _matrix_rows(out: str) -> list[list[str]]:
    """The table's rows: cell, P/R by alerts, live, offline ("ok" for a healthy cell), fire s, wall s, ok/FAIL."""
    rows = (line.split() for line in out.splitlines() if re.match(r"[\w-]+:[\w-]+:[\w-]+:\S+\s", line))
    return [row for row in rows if len(row) >= 7 and row[6] in ("ok", "FAIL")]


def _cells_held(out: str) -> float:
    rows = _matrix_rows(out)
    return sum(row[6] == "ok" for row in rows) / len(rows)


def _quiet_runs(out: str) -> float:
    runs = [line for line in out.splitlines() if line.startswith("ddp ")]
    return sum("no alert, nothing found" in line for line in runs) / len(runs)


def _slowest(*faults: str) -> Callable[[str], float]:
    def read(out: str) -> float:
        times = [float(row[4]) for row in _matrix_rows(out) if row[0].split(":")[1] in faults and row[4] != "-"]
        return max(times)
    return read


@dataclasses.dataclass(frozen=True)
class Goal:
    text: str
    bench: str
    read: Callable[[str], float]
    unit: str
    at_most: float | None = None
    at_least: float | None = None

    def met(self, figure: float) -> bool:
        return (self.at_most is None or figure <= self.at_most) and (self.at_least is None or figure >= self.at_least)


GOALS = (
    Goal("the hot path adds ≤ 1.5 µs per collective (no user hooks)", "hook_overhead",
         _number(r"hot path, no user hooks: ([\d.]+) µs"), "µs", at_most=1.5),
    Goal("an OpenTelemetry SDK span per op costs ≥ 15× commlens' hot path", "hook_overhead",
         _number(r"= ([\d.]+)x commlens' added cost"), "×", at_least=15),
    Goal("the sidecar drains and aggregates ≥ 300k records/s on one core", "export_throughput",
         _number(r"drain and aggregate: (\d+)k records/s"), "k/s", at_least=300),
    Goal("commlens builds and encodes spans ≥ 2× as fast as the SDK's path", "export_throughput",
         lambda out: float(re.search(r"OpenTelemetry SDK path [\d.]+k/s = ([\d.]+)x", out).group(1)), "×",
         at_least=2),
    Goal("the NaN/Inf check costs ≤ 1.2× one torch.sum of the payload (the worst payload)", "nan_check",
         _nan_check_worst(0), "×", at_most=1.2),
    Goal("a payload holding Inf costs the check ≤ 2× a finite one (the worst payload)", "nan_check",
         _nan_check_worst(1), "×", at_most=2),
    Goal("replica fingerprints at the default sampling (every 61st collective): ≤ 1 % of a DDP step",
         "fingerprints", _number(r"^61\s+([\d.]+)%"), "%", at_most=1),
    Goal("CPU commlens uses per collective, one rank, default: ≤ 5 µs", "agent_cost",
         _number(r"^default\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+([\d.]+)$"), "µs", at_most=5),
    Goal("CPU commlens uses per collective on rank 0 of two, default (training thread + its threads): ≤ 5 µs",
         "latency_loop", _two_ranks_cpu, "µs", at_most=5),
    Goal("a DDP step of 2 ranks, default, median wall ratio over none: ≤ 1.03×", "step_cost",
         _number(r"^default\s+[\d.]+ ms\s+[\d.]+ - ([\d.]+) -"), "×", at_most=1.03),
    Goal("resident memory over 1,000,000 collectives, last over first tenth: ≤ 1.05×", "memory_flat",
         _rss_growth, "×", at_most=1.05),
    Goal("one Prometheus, 10,000 ranks: every fault's alert names its culprit and only it, no other fires", "scale",
         _all_right("10,000 ranks:"), "", at_least=1),
    Goal("vmalert over VictoriaMetrics and two sharded vmagents, 10,000 ranks: the same", "victoria",
         _all_right("10,000 ranks,"), "", at_least=1),
    Goal("three Prometheus servers sharded by job, 10,000 ranks: the same", "shards",
         _all_right("10,000 ranks,"), "", at_least=1),
    Goal("healthy DDP jobs of 10 minutes (4 precisions): runs with no alert and nothing found", "replica_soak",
         _quiet_runs, "of runs", at_least=1),
    Goal("the verdict matrix: cells where every reader names the culprit and no one else", "detection",
         _cells_held, "of cells", at_least=1),
    Goal("NaN/Inf origin named ≤ 5 s after the fault (slowest cell)", "detection", _slowest("nan", "inf"), "s",
         at_most=5),
    Goal("a late, leaving or killed rank named ≤ threshold (3 s) + 5 s after the fault (slowest cell)", "detection",
         _slowest("late", "leave", "kill"), "s", at_most=8),
    Goal("a straggler named ≤ 10 s after it starts (slowest cell)", "detection",
         _slowest("slow-data", "slow-compute"), "s", at_most=10),
    Goal("silent corruption (a corrupted result, a diverging input) named ≤ 10 s after the fault (slowest cell)",
         "detection", _slowest("corrupt", "grow", "flip"), "s", at_most=10),
)


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    import torch
    return f"{os.cpu_count()} cores ({model}), Python {platform.python_version()}, torch {torch.__version__}"


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return head.strip() + (" with uncommitted changes" if dirty else "")


def write_result(bench: Bench, output: str, started: datetime.datetime, seconds: float, at: str) -> None:
    header = [f"# command: python {' '.join(bench.argv)}", f"# date: {started:%Y-%m-%d %H:%M} UTC",
              f"# commit: {at}", f"# machine: {machine()}", f"# seconds: {seconds:.0f}"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{bench.name}.txt").write_text("\n".join(header) + "\n" + output)


def read_result(name: str) -> tuple[dict[str, str], str]:
    text = (RESULTS / f"{name}.txt").read_text()
    lines = text.splitlines(keepends=True)
    head = [line for line in lines if line.startswith("# ")]
    meta = dict(line[2:].rstrip("\n").split(": ", 1) for line in head)
    return meta, "".join(lines[len(head):])


def render() -> str:
    """docs/figures.md from bench/results/ (a bench with no result yet is said to have none)."""
    results = {bench.name: read_result(bench.name) for bench in BENCHES if (RESULTS / f"{bench.name}.txt").exists()}
    out = ["# Figures", "", "Written by `python bench/run_all.py` from `bench/results/`: do not edit. Each goal is "
           "read from its bench's latest run and judged on it; each bench's output follows whole, with the "
           "date, commit and machine it was measured on. What each bench measures, and how: "
           "[performance.md](performance.md).", "", "## Goals", "", "| goal | figure | | measured |",
           "| --- | ---: | --- | --- |"]
    for goal in GOALS:
        if goal.bench not in results:
            out.append(f"| {goal.text} | not measured yet | | [{goal.bench}](#{goal.bench}) |")
            continue
        meta, output = results[goal.bench]
        figure = goal.read(output)
        shown = f"{figure:.0%}" if goal.unit in ("of cells", "of runs") else f"{figure:g} {goal.unit}".strip()
        if goal.bench in ("scale", "victoria", "shards"):
            shown = "right" if figure else "wrong"
        out.append(f"| {goal.text} | {shown} | {'met' if goal.met(figure) else '**missed**'} | "
                   f"[{goal.bench}](#{goal.bench}), {meta['commit']} |")
    for bench in BENCHES:
        if bench.name not in results:
            out += ["", f"## {bench.name}", "", f"{bench.what[:1].upper()}{bench.what[1:]}. No result yet: `python bench/run_all.py --only "
                    f"{bench.name}`."]
            continue
        meta, output = results[bench.name]
        out += ["", f"## {bench.name}", "", f"{bench.what[:1].upper()}{bench.what[1:]}. `{meta['command']}`: {meta['date']}, commit "
                f"{meta['commit']}, {meta['seconds']} s; {meta['machine']}.", "", "```", output.rstrip("\n"), "```"]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help=f"comma-separated, of: {', '.join(b.name for b in BENCHES)}")
    parser.add_argument("--render", action="store_true", help="write docs/figures.md from the stored results only")
    args = parser.parse_args()
    names = {b.name for b in BENCHES}
    chosen = set(args.only.split(",")) if args.only else names
    if chosen - names:
        parser.error(f"--only {','.join(sorted(chosen - names))} is not a bench here: give any of {', '.join(names)}")
    if not args.render:
        at = commit()
        for bench in (b for b in BENCHES if b.name in chosen):
            print(f"== {bench.name}: python {' '.join(bench.argv)}", flush=True)
            started, clock = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
            done = subprocess.run([sys.executable, *bench.argv], cwd=ROOT, stdout=subprocess.PIPE, text=True)
            if done.returncode != 0:
                print(f"{bench.name} failed (exit {done.returncode}); its stored result is kept", file=sys.stderr)
                return 1
            write_result(bench, done.stdout, started, time.monotonic() - clock, at)
    FIGURES.write_text(render())
    print(f"wrote {FIGURES.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
