"""What recording a functional collective costs, measured in one run against the same calls unrecorded.

A 4 KiB ``funcol.all_reduce`` followed by its wait, on a one-rank gloo group (the backend does no
network work, so the figure is the Python and dispatcher path that commlens adds to), with
``instrument()`` on against off, alternated to even out drift.

    python bench/functional.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commlens.hooks as ch
from commlens.agent.cli.ports import free_port

BATCH, BATCHES = 500, 20


def _median_us(fn) -> float:
    samples = []
    for _ in range(BATCHES):
        start = time.perf_counter_ns()
        for _ in range(BATCH):
            fn()
        samples.append((time.perf_counter_ns() - start) / BATCH / 1000)
    return statistics.median(samples)


def main() -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    pg, tensor = dist.group.WORLD, torch.ones(1024)
    results: dict[str, list[float]] = {"off": [], "on": []}
    for mode in ("off", "on", "off", "on"):
        (ch.instrument if mode == "on" else ch.uninstrument)()
        results[mode].append(_median_us(lambda: funcol.all_reduce(tensor, "sum", pg).wait()))
    ch.uninstrument()
    dist.destroy_process_group()
    off, on = min(results["off"]), min(results["on"])
    print(f"funcol all_reduce + wait, 4 KiB, 1 rank: {off:.1f} µs plain, {on:.1f} µs recorded "
          f"= +{on - off:.1f} µs ({on / off:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
