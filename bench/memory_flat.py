"""Resident memory and CPU per collective as a long job grows: flat, or not.

One gloo rank runs 1,000,000 all_reduces (``--collectives``) spread over 100 process groups and 1,000
distinct shapes (10 element counts x 20 tensor ranks x 5 dtypes), with the whole agent
started at its defaults (hooks, ring, sidecar, metrics, the span budget writing spans to a file).
Every tenth of the run it prints the process's resident memory, the metrics series it exposes and
the CPU time per collective over that tenth; the same loop without commlens, first, gives the
baseline CPU per collective. Flat means the last tenth costs what the second did.

    python bench/memory_flat.py [--collectives 1000000]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from commlens.agent.cli.ports import free_port

GROUPS, COUNTS, RANKS = 100, 10, 20
DTYPES = (torch.float32, torch.float64, torch.float16, torch.int32, torch.int64)  # gloo reduces these


def _tensors() -> list[torch.Tensor]:
    """1,000 distinct (shape, dtype) signatures: element counts 1..10 x tensor ranks 1..20 x 5 dtypes."""
    shapes = []
    for count in range(1, COUNTS + 1):
        for dims in range(1, RANKS + 1):
            shapes.append((count,) + (1,) * (dims - 1))
    return [torch.ones(shape, dtype=dtype) for shape in shapes for dtype in DTYPES]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _series(collector) -> int:
    return sum(len(family.samples) for family in collector.collect())


def _run(total: int, groups: list, tensors: list, report) -> float:
    """``total`` all_reduces cycling over groups and signatures; returns CPU µs per collective
    (``report``, called every tenth, is not counted)."""
    tenth, spent = total // 10, 0.0
    window_cpu = _cpu_s()
    for i in range(total):
        dist.all_reduce(tensors[i % len(tensors)], group=groups[(i // len(tensors)) % len(groups)])
        if (i + 1) % tenth == 0:
            cpu_us = (_cpu_s() - window_cpu) / tenth * 1e6
            spent += cpu_us
            report(i + 1, cpu_us)
            window_cpu = _cpu_s()
    return spent / 10


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="commlens-memory-") as folder:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          COMMLENS_METRICS_PORT="0", COMMLENS_TRACE_FILE=os.path.join(folder, "spans.jsonl"))
        dist.init_process_group("gloo", rank=0, world_size=1)
        groups, tensors = [dist.new_group([0]) for _ in range(GROUPS)], _tensors()
        baseline = _run(args.collectives // 10, groups, tensors, lambda done, cpu: None)
        print(f"without commlens: {baseline:.1f} CPU µs per collective; {_rss_mib():.0f} MiB resident")

        import commlens.agent

        agent = commlens.agent.start()
        print(f"{'collectives':>12}{'RSS MiB':>10}{'series':>8}{'CPU µs/coll':>13}{'commlens µs':>13}")

        def report(done: int, cpu_us: float) -> None:
            print(f"{done:>12,}{_rss_mib():>10.0f}{_series(agent.collector):>8}{cpu_us:>13.1f}"
                  f"{cpu_us - baseline:>13.1f}", flush=True)

        started = time.perf_counter()
        _run(args.collectives, groups, tensors, report)
        elapsed = time.perf_counter() - started
        commlens.agent.stop()
        print(f"{args.collectives:,} collectives in {elapsed:.0f} s; spans written: {agent.spans.counts['exported']:,}, "
              f"sampled out: {agent.spans.counts['sampled_out']:,}")
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
