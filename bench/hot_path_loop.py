"""The hooks' cost on the training thread in a loop of collectives, configurations alternated in one process.

``bench/hook_overhead.py`` times the hot path alone, with a backend that returns at once; in a real loop
the training thread pays several times that, in the caches and hand-offs it shares with c10d and gloo.
This runs one gloo rank's loop of all_reduces of 4 KiB and switches the configuration in place between
slices (``--slices`` rounds, each configuration once a round, the order reversed every other round),
so that every slice is paired with a no-commlens slice of the same round, in the same process and on
the same core placement: steadier than a fresh job per trial (``bench/agent_cost.py``).

Configurations: ``none``; ``floor`` (a plain Python wrapper around ``all_reduce`` that writes START and
END to the ring with constant fields: what any wrapper in Python costs there); ``wrappers``
(``commlens.hooks.instrument()``, no hooks registered); ``nan-check`` (the wrappers and the NaN/Inf
check, as the agent's default registers it); on torch >= 2.14 also ``no-pg-hooks`` (the wrappers with
PyTorch's process-group hooks detached: what those hooks cost while the wrappers record). Printed: the training thread's CPU (``time.thread_time``)
and wall time per collective over ``none``, medians with the quartiles.

The process runs on one core (``--no-pin``: on every core it may use). Across two cores the training
thread wakes gloo's thread on the other core for every collective, and whatever the training thread
does between collectives decides whether that thread is still awake: on this 2-core machine a
collective then costs 2-3x the CPU, and a slice's figure varies by +-10 µs, more than the hooks cost.

    python bench/hot_path_loop.py                   # the figures (about 2 minutes)
    python bench/hot_path_loop.py --slices 2 --collectives 200   # every configuration once, briefly
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import commlens.hooks as ch
from commlens.agent.cli.ports import free_port
from commlens.hooks import native, process_ring, record
from commlens.hooks.nan_check import NanCheckHook
from commlens.hooks.patch import Patch


class Floor:
    """A plain Python wrapper that asks c10d for the sequence number and writes START and END."""

    def __init__(self) -> None:
        write, seq_of = process_ring.ring().write, c10d._get_default_group()._get_sequence_number_for_group

        def make(original):
            def all_reduce(*args, **kwargs):
                seq = seq_of()
                record.start(write, 1, 1, 1, seq, 4096, 1, -1)
                result = original(*args, **kwargs)
                record.end(write, 1, 1, 1, seq, 4096, 1, -1)
                return result

            return all_reduce

        self._patch = Patch(c10d.all_reduce, make)

    def undo(self) -> None:
        self._patch.undo()


class Wrappers:
    def __init__(self, nan_check: bool = False, pg_hooks: bool = True) -> None:
        ch.instrument()
        self._check = NanCheckHook().register_with_comm() if nan_check else None
        if not pg_hooks:
            native.detach()

    def undo(self) -> None:
        if self._check is not None:
            self._check.unregister()
        ch.uninstrument()


CONFIGS = {"none": None, "floor": Floor, "wrappers": Wrappers, "nan-check": lambda: Wrappers(nan_check=True),
           **({"no-pg-hooks": lambda: Wrappers(pg_hooks=False)} if native.AVAILABLE else {})}


def quartiles(values: list[float]) -> str:
    """The median and quartiles of ``values``, as the tables print them."""
    q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{median:7.2f} ({q1:.2f} - {q3:.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=24, help="rounds of every configuration (default 24)")
    parser.add_argument("--collectives", type=int, default=3000, help="all_reduces timed per slice (default 3000)")
    parser.add_argument("--no-pin", action="store_true", help="run on every core allowed, not on one")
    args = parser.parse_args()
    if not args.no_pin:  # before gloo starts its threads, which inherit it
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    tensor = torch.zeros(1024)
    for _ in range(2000):
        dist.all_reduce(tensor)
    cpu: dict[str, list[float]] = {name: [] for name in CONFIGS}
    wall: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for round_ in range(args.slices):
        for name in list(CONFIGS)[:: 1 if round_ % 2 == 0 else -1]:
            applied = CONFIGS[name]() if CONFIGS[name] else None
            for _ in range(args.collectives // 10):  # warm the configuration's path
                dist.all_reduce(tensor)
            cpu_started, wall_started = time.thread_time(), time.perf_counter()
            for _ in range(args.collectives):
                dist.all_reduce(tensor)
            cpu[name].append((time.thread_time() - cpu_started) / args.collectives * 1e6)
            wall[name].append((time.perf_counter() - wall_started) / args.collectives * 1e6)
            if applied is not None:
                applied.undo()
    dist.destroy_process_group()
    print("configuration  training-thread CPU us over none (q1 - q3)  wall us over none (q1 - q3)  none: CPU, wall us")
    for name in CONFIGS:
        extra_cpu = [c - n for c, n in zip(cpu[name], cpu["none"])]
        extra_wall = [w - n for w, n in zip(wall[name], wall["none"])]
        print(f"{name:13s}  {quartiles(extra_cpu)}  {quartiles(extra_wall)}  "
              f"{statistics.median(cpu['none']):.2f} {statistics.median(wall['none']):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
