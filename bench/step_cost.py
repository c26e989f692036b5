"""The whole agent's cost on a DDP training step, against no commlens, paired in one run.

Two gloo ranks train a DDP model (3 x Linear(1024), batch 64) in rounds that alternate between no
commlens and ``commlens.agent.start()`` at its defaults (NaN/Inf check on, span budget, metrics at
the default detail level, spans to the embedded file sink); every round builds a fresh DDP model,
warms it up, then times ``--steps`` steps. Each commlens round is paired with the no-commlens round
before it; the ratios' min - median - max are printed, with the medians of the step times, and the
spans a rank wrote per second at the default span budget against the collectives it ran.

    python bench/step_cost.py --rounds 8 --steps 60
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from commlens.agent.demo import free_port


def _round(steps: int) -> float:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024)
    for step in range(steps + 5):  # 5 warm-up steps
        if step == 5:
            dist.barrier()
            start = time.perf_counter()
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps


def _rank(rank: int, port: int, rounds: int, steps: int, out: dict) -> None:
    import commlens.agent
    from commlens.agent import Config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    with tempfile.TemporaryDirectory(prefix="commlens-step-cost-") as folder:
        times = {"off": [], "on": [], "spans_per_s": [], "collectives_per_s": []}
        for _ in range(rounds):
            times["off"].append(_round(steps))
            started = time.perf_counter()
            agent = commlens.agent.start(Config.from_env({
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "COMMLENS_METRICS_PORT": "0",
                "COMMLENS_TRACE_FILE": os.path.join(folder, "t-{rank}.jsonl")}))
            times["on"].append(_round(steps))
            seconds = time.perf_counter() - started
            commlens.agent.stop()
            times["spans_per_s"].append(agent.spans.counts["exported"] / seconds)
            times["collectives_per_s"].append(sum(agent.spans.counts.values()) / seconds)
    out[rank] = times
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(free_port(), args.rounds, args.steps, out), nprocs=2, start_method="spawn")
        times = out[0]
    ratios = sorted(on / off for off, on in zip(times["off"], times["on"]))
    print(f"DDP step, 2 gloo ranks, {args.rounds} paired rounds of {args.steps} steps (rank 0):")
    print(f"  no commlens: median {statistics.median(times['off']) * 1e3:.2f} ms")
    print(f"  commlens defaults: median {statistics.median(times['on']) * 1e3:.2f} ms")
    print(f"  ratio (paired): {ratios[0]:.3f} - {statistics.median(ratios):.3f} - {ratios[-1]:.3f} (min - median - max)")
    print(f"  spans written per second per rank: median {statistics.median(times['spans_per_s']):.0f}, of "
          f"{statistics.median(times['collectives_per_s']):.0f} collectives per second")


if __name__ == "__main__":
    main()
