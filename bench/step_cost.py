"""The whole agent's cost on a training step or a collective, against no commlens, in one job: wall
time and CPU.

Two gloo ranks run one of ``agent_cost.py``'s workloads (a DDP or FSDP2 step of 3 x Linear(1024),
batch 64; an all_reduce of 4 KiB, 1 MiB or 64 MiB) in rounds that alternate no commlens and ``commlens.agent.start()`` under one configuration,
in the order ABBA, so that neither side is always first; each round times ``--steps`` steps after a
warm-up, and each commlens round is paired with the no-commlens round beside it. One job for all the
rounds takes out what makes two fresh jobs differ here by up to 20 % (where the scheduler puts each
rank's and gloo's threads), so a ratio of a few per mille can be told from none: the ``none-again``
configuration (no commlens in either round) is that resolution. Per configuration: rank 0's step
time without commlens, and the paired ratios' min - median - max of its wall time and of the CPU its
process used (every thread, ``time.process_time``).

    python bench/step_cost.py --rounds 16
    python bench/step_cost.py --workload "all_reduce 4 KiB" --rounds 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agent_cost import WORKLOADS, workload_step
from commlens.agent.cli.ports import free_port

STEPS = {"all_reduce 4 KiB": 300, "all_reduce 1 MiB": 60, "all_reduce 64 MiB": 4, "DDP step": 30, "FSDP2 step": 20}
"""Steps timed per round unless ``--steps`` says: about 0.5 s of each workload here."""
CONFIGS = {
    "none-again": None,  # no commlens in either round: the pairing's own noise
    "default": {},
    "no-nan-check": {"COMMLENS_NAN_CHECK": "off"},
    "every-span": {"OTEL_TRACES_SAMPLER": "always_on"},
}


def _round(step, steps: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per step over ``steps`` steps, after 3 to warm up."""
    for _ in range(3):
        step()
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def _rank(rank: int, port: int, workload: str, rounds: int, steps: int, configs: list[str], out: dict) -> None:
    import commlens.agent
    from commlens.agent import Config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    step = workload_step(workload)
    times = {config: {"off": [], "on": []} for config in configs}
    with tempfile.TemporaryDirectory(prefix="commlens-step-cost-") as folder:
        for config in configs:
            for n in range(rounds):
                for on in (False, True) if n % 2 == 0 else (True, False):
                    agent = on and CONFIGS[config] is not None
                    if agent:
                        commlens.agent.start(Config.from_env({
                            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "COMMLENS_METRICS_PORT": "0",
                            "COMMLENS_TRACE_FILE": os.path.join(folder, "t-{rank}.jsonl"), **CONFIGS[config]}))
                    times[config]["on" if on else "off"].append(_round(step, steps))
                    if agent:
                        commlens.agent.stop()
    if rank == 0:
        out["times"] = times
    dist.destroy_process_group()


def _spread(values: list[float]) -> str:
    values = sorted(values)
    return f"{values[0]:.3f} - {statistics.median(values):.3f} - {values[-1]:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=list(WORKLOADS), default="DDP step")
    parser.add_argument("--rounds", type=int, default=16, help="ABBA pairs of rounds per configuration")
    parser.add_argument("--steps", type=int, help="steps timed per round (default: the workload's in STEPS)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    args = parser.parse_args()
    args.steps = args.steps or STEPS[args.workload]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(free_port(), args.workload, args.rounds, args.steps, args.configs, out),
                           nprocs=2, start_method="spawn")
        times = out["times"]
    print(f"{args.workload}, 2 gloo ranks, {args.rounds} paired rounds of {args.steps} steps per configuration (rank 0)")
    print(f"{'config':<14}{'step without':>14}{'wall ratio min - median - max':>32}{'CPU ratio min - median - max':>31}")
    for config, t in times.items():
        wall = [on[0] / off[0] for off, on in zip(t["off"], t["on"])]
        cpu = [on[1] / off[1] for off, on in zip(t["off"], t["on"])]
        print(f"{config:<14}{statistics.median(w for w, _ in t['off']) * 1e3:>11.2f} ms{_spread(wall):>32}{_spread(cpu):>31}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
