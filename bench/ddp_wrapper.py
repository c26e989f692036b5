"""What the DDP wrapper adds per gradient bucket, against the same hook unwrapped, in one run.

One gloo rank, a DDP model of 8 small linear layers in 8 buckets; backward passes timed with
PyTorch's ``allreduce_hook`` registered plain and wrapped by ``commlens.hooks.ddp.wrap`` (with
``instrument()`` on, so the hook's own all_reduce is seen and not recorded twice). Medians of rounds
that alternate the two.

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

from commlens.agent.demo import free_port
from commlens.hooks import ddp, instrument, uninstrument

LAYERS, STEPS, ROUNDS = 8, 200, 7


def _model(hook) -> DDP:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(LAYERS)]), bucket_cap_mb=0.01)
    model.register_comm_hook(None, hook)
    x = torch.randn(4, 64)
    for _ in range(2):  # DDP rebuilds its buckets after the first backward
        model(x).sum().backward()
    return model


def _per_bucket_us(model: DDP) -> float:
    x = torch.randn(4, 64)
    start = time.perf_counter()
    for _ in range(STEPS):
        model(x).sum().backward()
    return (time.perf_counter() - start) / STEPS / LAYERS * 1e6


def main() -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    plain = _model(default_hooks.allreduce_hook)
    instrument()
    wrapped = _model(ddp.wrap(default_hooks.allreduce_hook))
    times = {"plain": [], "wrapped": []}
    for _ in range(ROUNDS):
        uninstrument()
        times["plain"].append(_per_bucket_us(plain))
        instrument()
        times["wrapped"].append(_per_bucket_us(wrapped))
    uninstrument()
    dist.destroy_process_group()
    p, w = statistics.median(times["plain"]), statistics.median(times["wrapped"])
    print(f"DDP backward per bucket ({LAYERS} buckets): {p:.1f} µs plain allreduce_hook, {w:.1f} µs wrapped "
          f"= {w - p:.1f} µs added per bucket ({w / p:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
