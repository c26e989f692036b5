"""What module attribution costs, measured in one run against the same calls without it.

1. Per collective: the recorded hot path (an all_reduce whose backend returns at once, issued inside
   a module's forward) with attribution on, against off.
2. Per module call: a forward through 16 small layers with attribution's global module hooks on,
   against off (attribution adds a pre- and post-hook to every module call).

    python bench/attribution.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from commlens.agent.cli.ports import free_port
from commlens.hooks import OpName, attribution
from commlens.hooks.distributed import _all_reduce, _instrumented

BATCH, BATCHES, INNER = 2000, 30, 100


def _median_us(fn, per_call: int = 1, batch: int = BATCH) -> float:
    samples = []
    for _ in range(BATCHES):
        start = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter_ns() - start) / batch / per_call / 1000)
    return statistics.median(samples)


def main() -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    tensor = torch.ones(1024)
    all_reduce = _instrumented(OpName.all_reduce, lambda tensor, op=None, group=None, async_op=False: None,
                               _all_reduce)

    class Issues(torch.nn.Module):
        def forward(self, x):
            for _ in range(INNER):
                all_reduce(x)
            return x

    issuer = Issues()
    layers = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(16)])
    results = {}
    for mode in ("off", "on", "off", "on"):
        (attribution.enable if mode == "on" else attribution.disable)()
        results.setdefault(("collective", mode), []).append(_median_us(lambda: issuer(tensor), INNER, batch=20))
        results.setdefault(("module", mode), []).append(_median_us(lambda: layers(tensor), 17))
    attribution.disable()
    dist.destroy_process_group()
    c_off, c_on = (min(results[("collective", m)]) for m in ("off", "on"))
    m_off, m_on = (min(results[("module", m)]) for m in ("off", "on"))
    print(f"recorded collective inside a forward: {c_off:.2f} µs off, {c_on:.2f} µs on = +{c_on - c_off:.2f} µs")
    print(f"module call: {m_off:.2f} µs off, {m_on:.2f} µs on = +{m_on - m_off:.2f} µs per module call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
