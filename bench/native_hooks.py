"""What each way of reaching a collective adds to it, on torch >= 2.14, in one run.

Paths: commlens' wrappers of the public API alone; PyTorch's process-group hooks alone (``native``);
both, as ``instrument()`` sets them up (the native hooks step aside for what a wrapper records).
Each is timed sync and async (``async_op=True`` then ``wait()``), with no user hook and with one
no-op user pre-hook, against the plain call in alternating batches; medians, µs added per collective.

Two backends: PyTorch's ``fake`` process group (a collective that returns at once: the issuing
thread's own cost, exactly) and a 1-rank gloo group (everything, completion callbacks included, on
top of gloo's own ~30-60 µs and its noise).

    python bench/native_hooks.py [--batches 20] [--batch 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import commlens.hooks as ch
from commlens.agent.cli.ports import free_port
from commlens.hooks import native

PATHS = ("wrappers", "native", "both")


def _setup(path: str) -> None:
    if path == "wrappers":
        ch.instrument()
        native.detach()
    elif path == "native":
        native.attach()
    else:
        ch.instrument()


def _teardown() -> None:
    ch.uninstrument()
    native.detach()


def _batch(mode: str, tensor: torch.Tensor, size: int) -> float:
    start = time.perf_counter_ns()
    if mode == "sync":
        for _ in range(size):
            dist.all_reduce(tensor)
    else:
        for _ in range(size):
            dist.all_reduce(tensor, async_op=True).wait()
    return (time.perf_counter_ns() - start) / size / 1000


def added(batches: int, size: int) -> dict[tuple[str, str, bool], float]:
    tensor = torch.ones(256)
    found: dict[tuple[str, str, bool], list[float]] = {}
    for _ in range(batches):
        for mode in ("sync", "async"):
            for user_hook in (False, True):
                plain = _batch(mode, tensor, size)
                for path in PATHS:
                    _setup(path)
                    handle = ch.register_pre_hook(lambda args: None) if user_hook else None
                    cost = _batch(mode, tensor, size)
                    if handle is not None:
                        handle.remove()
                    _teardown()
                    found.setdefault((path, mode, user_hook), []).append(cost - plain)
    return {key: statistics.median(values) for key, values in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2000)
    args = parser.parse_args()
    if not native.AVAILABLE:
        raise SystemExit(f"torch {torch.__version__} has no process-group hooks: run this on torch >= 2.14")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    results = {}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    results["fake"] = added(args.batches, args.batch)
    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    results["gloo"] = added(max(3, args.batches // 4), args.batch // 4)
    dist.destroy_process_group()
    print(f"torch {torch.__version__}: µs added per all_reduce of 1 KiB over the plain call (medians)")
    print(f"{'backend':>8} {'path':>9} {'sync':>8} {'sync+hook':>10} {'async':>8} {'async+hook':>11}")
    for backend, table in results.items():
        for path in PATHS:
            row = [table[(path, mode, hook)] for mode in ("sync", "async") for hook in (False, True)]
            print(f"{backend:>8} {path:>9} " + " ".join(f"{value:>8.2f}" if i % 2 == 0 else f"{value:>10.2f}"
                                                       for i, value in enumerate(row)))


if __name__ == "__main__":
    main()
