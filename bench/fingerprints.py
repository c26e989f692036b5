"""Replica fingerprints' cost (``hooks/fingerprints.py``): one fingerprint of a collective's result against
payload size, against one ``torch.sum`` of the same payload (the floor: one pass over it); then on a DDP
step (``agent_cost.py``'s: 3 x Linear(1024), batch 64, one gloo rank), what
fingerprinting every Nth of its data-parallel group's collectives adds, as a share of the step: a step's
gradient buckets fingerprinted once, over N (every bucket is as likely to be the Nth), against the step
timed beside it. Medians of ``--repeats`` interleaved rounds, torch on one thread.

    python bench/fingerprints.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from agent_cost import _model
from commlens.agent.cli.ports import free_port
from commlens.hooks import fingerprints

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}
EVERY = (1, 13, 61, 251)
"""N: a group's collectives whose sequence number is a multiple of N fingerprinted (61: the default,
``COMMLENS_FINGERPRINT_EVERY``)."""


def _per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def payloads(repeats: int) -> list[str]:
    rows = [f"{'payload':<10}{'fingerprint µs':>16}{'sum µs':>10}{'/ sum':>8}"]
    for name, nbytes in SIZES.items():
        tensor = torch.ones(nbytes // 4)
        calls = max(3, (64 << 20) // nbytes // 4)
        rounds = [(_per_call(lambda: fingerprints.of((tensor,)), calls), _per_call(lambda: torch.sum(tensor), calls))
                  for _ in range(repeats)]
        fp, total = (statistics.median(r[k] for r in rounds) * 1e6 for k in range(2))
        rows.append(f"{name:<10}{fp:>16.2f}{total:>10.2f}{fp / total:>7.2f}x")
    return rows


def ddp_step(repeats: int, steps: int) -> list[str]:
    """The DDP step's time, its gradients' fingerprint (its buckets' results, once each), and the share of
    the step that fingerprinting every Nth collective of its group adds."""
    model = torch.nn.parallel.DistributedDataParallel(_model())
    optimizer, x = torch.optim.SGD(model.parameters(), lr=1e-3), torch.randn(64, 1024)

    def step() -> None:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()

    step()
    grads = tuple(p.grad for p in model.parameters())
    rounds = [(_per_call(step, steps), _per_call(lambda: fingerprints.of(grads), steps)) for _ in range(repeats)]
    step_s, fp_s = (statistics.median(r[k] for r in rounds) for k in range(2))
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    rows = [f"DDP step {step_s * 1e3:.2f} ms; its gradients ({nbytes / 2**20:.1f} MiB) fingerprinted once "
            f"{fp_s * 1e6:.0f} µs ({fp_s / step_s:.2%} of the step)",
            f"{'every N':<10}{'added to the step':>18}"]
    rows += [f"{every:<10}{fp_s / every / step_s:>17.3%}" + ("  (the default)" if every == 61 else "") for every in EVERY]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        print("\n".join(payloads(args.repeats) + [""] + ddp_step(args.repeats, args.steps)))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
