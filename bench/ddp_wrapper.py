"""What commlens adds per DDP gradient bucket, against DDP on its own, in one run.

One gloo rank, a DDP model of 8 small linear layers in 8 buckets; backward passes timed, in rounds
that alternate the configurations:

- ``built-in``: no hook registered, so DDP reduces each bucket with its built-in C++ hook;
- ``python hook``: PyTorch's ``allreduce_hook`` registered, plain (a Python hook, and its callback on
  gloo's thread);
- ``commlens``: the hookless model under ``instrument()``, as the agent runs it (commlens' own
  ``allreduce_hook``, recording each bucket);
- ``commlens, user hook``: PyTorch's ``allreduce_hook`` registered under ``instrument()`` (wrapped).

Medians of the rounds, wall and process CPU per bucket.

    python bench/ddp_wrapper.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from commlens.agent.cli.ports import free_port
from commlens.hooks import instrument, uninstrument

LAYERS, STEPS, ROUNDS = 8, 200, 7


def _model(hook=None) -> DDP:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(LAYERS)]), bucket_cap_mb=0.01)
    if hook is not None:
        model.register_comm_hook(None, hook)
    x = torch.randn(4, 64)
    for _ in range(2):  # DDP rebuilds its buckets after the first backward; the first forward registers commlens' hook
        model(x).sum().backward()
    return model


def _per_bucket_us(model: DDP) -> tuple[float, float]:
    """(wall, process CPU) µs per bucket over ``STEPS`` backward passes."""
    x = torch.randn(4, 64)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(STEPS):
        model(x).sum().backward()
    return ((time.perf_counter() - wall) / STEPS / LAYERS * 1e6, (time.process_time() - cpu) / STEPS / LAYERS * 1e6)


def main() -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    models = {"built-in": (_model(), False), "python hook": (_model(default_hooks.allreduce_hook), False)}
    instrument()
    models["commlens"] = (_model(), True)
    models["commlens, user hook"] = (_model(default_hooks.allreduce_hook), True)
    uninstrument()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    for _ in range(ROUNDS):
        for name, (model, instrumented) in models.items():
            if instrumented:
                instrument()
            times[name].append(_per_bucket_us(model))
            if instrumented:
                uninstrument()
    dist.destroy_process_group()
    base = [statistics.median(t[i] for t in times["built-in"]) for i in (0, 1)]
    print(f"DDP backward per bucket, 1 gloo rank, {LAYERS} buckets, medians of {ROUNDS} rounds (µs):")
    print(f"{'configuration':<22}{'wall':>8}{'over built-in':>15}{'CPU':>8}{'over built-in':>15}")
    for name, runs in times.items():
        wall, cpu = (statistics.median(t[i] for t in runs) for i in (0, 1))
        print(f"{name:<22}{wall:>8.1f}{wall - base[0]:>+15.1f}{cpu:>8.1f}{cpu - base[1]:>+15.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
