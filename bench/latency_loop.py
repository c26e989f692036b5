"""The latency commlens adds to a latency-bound loop: 2 gloo ranks, all_reduces of 4 KiB, configurations
alternated in place in both ranks.

``bench/agent_cost.py`` starts a fresh job per trial, and two such jobs without commlens differ by up
to 20 % here. This runs one 2-rank job and switches the configuration in both ranks at the same
collective, between slices (``--slices`` rounds, each configuration once a round, the order reversed
every other round), so that every slice is paired with a no-commlens slice of the same round.

Configurations: ``none``; ``hooks`` (``commlens.hooks.instrument()`` and the NaN/Inf check as the agent
registers it: the hot path alone, no thread of commlens'); ``agent`` (``commlens.agent.start()``, its
defaults: the hot path and the agent's threads, spans to a file, no metrics port). Printed for rank 0,
per collective, medians over the slices with the quartiles, over ``none``: wall time, the training
thread's CPU, the time it waited on a run queue while runnable (``/proc/.../schedstat``: another thread
had the core), and its context switches; and commlens' own threads' CPU.

    python bench/latency_loop.py                  # the figures (about 2 minutes on 2 cores)
    python bench/latency_loop.py --slices 2 --collectives 200   # every configuration once, briefly
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from commlens.agent.cli.ports import free_port
from hot_path_loop import Wrappers, quartiles

CONFIGS = ("none", "hooks", "agent")


class Agent:
    def __init__(self) -> None:
        import commlens.agent

        commlens.agent.start()

    def undo(self) -> None:
        import commlens.agent

        commlens.agent.stop()


def _task(tid: int) -> tuple[float, float, int]:
    """A thread's CPU seconds, seconds waited on a run queue, and context switches so far."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        ran, waited, _ = f.read().split()
    with open(f"/proc/self/task/{tid}/status") as f:
        switches = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
    return int(ran) / 1e9, int(waited) / 1e9, switches


def _commlens_cpu_s() -> float:
    return sum(_task(t.native_id)[0] for t in threading.enumerate() if t.name.startswith("commlens"))


def _rank(rank: int, port: int, slices: int, collectives: int, folder: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", COMMLENS_METRICS_PORT="0",
                      COMMLENS_TRACE_FILE=os.path.join(folder, f"traces-{rank}.jsonl"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    tensor, me = torch.zeros(1024), threading.get_native_id()
    for _ in range(2000):
        dist.all_reduce(tensor)
    figures: dict[str, list[tuple[float, ...]]] = {name: [] for name in CONFIGS}
    latencies: dict[str, list[int]] = {name: [] for name in CONFIGS}
    clock = time.perf_counter_ns
    for round_ in range(slices):
        for name in CONFIGS[:: 1 if round_ % 2 == 0 else -1]:
            applied = {"none": lambda: None, "hooks": lambda: Wrappers(nan_check=True), "agent": Agent}[name]()
            for _ in range(collectives // 10):  # warm the configuration's path
                dist.all_reduce(tensor)
            dist.barrier()
            ran, waited, switches = _task(me)
            threads, times = _commlens_cpu_s(), [0] * (collectives + 1)
            times[0] = clock()
            for i in range(1, collectives + 1):
                dist.all_reduce(tensor)
                times[i] = clock()
            wall = (times[-1] - times[0]) / 1e9
            latencies[name].extend(b - a for a, b in zip(times, times[1:]))
            ran_after, waited_after, switches_after = _task(me)
            figures[name].append(tuple(v / collectives for v in (
                wall * 1e6, (ran_after - ran) * 1e6, (waited_after - waited) * 1e6, switches_after - switches,
                (_commlens_cpu_s() - threads) * 1e6)))
            if applied is not None:
                applied.undo()
    if rank == 0:
        out.update(figures)
        out["latencies"] = {name: _percentiles(values) for name, values in latencies.items()}
    dist.destroy_process_group()


def _percentiles(values_ns: list[int]) -> dict[str, float]:
    """One collective's time, in µs: mean and percentiles."""
    ordered = sorted(values_ns)
    at = {f"p{p}": ordered[min(len(ordered) - 1, len(ordered) * p // 100)] / 1e3 for p in (10, 50, 90, 99)}
    return {"mean": statistics.fmean(ordered) / 1e3, **at, "p99.9": ordered[len(ordered) * 999 // 1000] / 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=12, help="rounds of every configuration (default 12)")
    parser.add_argument("--collectives", type=int, default=3000, help="all_reduces timed per slice (default 3000)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="commlens-latency-") as folder, mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(free_port(), args.slices, args.collectives, folder, out), nprocs=2,
                           start_method="spawn")
        figures = dict(out)
    latencies = figures.pop("latencies")
    none = figures["none"]
    print("rank 0, per collective, over none: median (q1 - q3)")
    print(f"{'config':<8}{'wall µs':>26}{'training CPU µs':>26}{'run-queue wait µs':>26}{'switches':>26}"
          f"{'commlens threads µs':>26}")
    for name in CONFIGS:
        columns = [quartiles([run[i] - base[i] for run, base in zip(figures[name], none)]) for i in range(4)]
        threads = quartiles([run[4] for run in figures[name]])
        print(f"{name:<8}" + "".join(f"{c:>26}" for c in columns) + f"{threads:>26}")
    base = [statistics.median(run[i] for run in none) for i in range(4)]
    print(f"none itself: wall {base[0]:.2f} µs, training CPU {base[1]:.2f} µs, run-queue wait {base[2]:.2f} µs, "
          f"{base[3]:.2f} switches")
    print(f"\none collective's time, all slices together, µs\n{'config':<8}" + "".join(f"{key:>10}" for key in latencies["none"]))
    for name, found in latencies.items():
        print(f"{name:<8}" + "".join(f"{value:>10.1f}" for value in found.values()))
    ratios = {name: statistics.median(r[0] / b[0] for r, b in zip(figures[name], none)) for name in CONFIGS[1:]}
    print("wall over none, median ratio: " + ", ".join(f"{name} {ratio:.3f}" for name, ratio in ratios.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
