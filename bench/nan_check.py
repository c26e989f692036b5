"""The NaN/Inf check's cost per collective against payload size, and against one ``torch.sum``.

The check is one pass over each input: a contiguous CPU tensor of up to 1 MiB of floats is scanned in
C for all-ones exponents (2^18 floats: 1 MiB of float32), a larger one summed by torch (a finite sum proves every element finite);
only a tensor found non-finite is counted element by element. What it adds to a collective is timed
on the training thread's hot path (``instrument()``'s all_reduce with a backend that returns at once,
so that no backend noise is in it), with ``NanCheckHook`` against without; beside it the check's pass
alone, one ``torch.sum`` of the same tensor (the floor; the goal: the check adds at most 1.2x
a sum), and a real world-size-1 gloo all_reduce with and without the check. Then the same payloads
holding one Inf each (a diverged job, an overflow storm: every collective's input is counted and its
NAN record written): what the check adds on the hot path then, over what it adds to the finite
payload (the goal: at most 2x). Medians of ``--repeats`` interleaved rounds (min - max of the
added time beside it), torch on one thread.

    python bench/nan_check.py
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
from commlens.hooks.distributed import _all_reduce, _instrumented
from commlens.hooks.nan_check import tensor_finite

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}


def _per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _backend_returns_at_once(tensor, op=None, group=None, async_op=False):
    return None


def _added(fn, calls: int, repeats: int) -> list[float]:
    """Seconds ``NanCheckHook`` adds to ``fn``, per round: rounds with and without it, in the order
    ABBA, so that a drift over the run cancels."""
    added = []
    for round_ in range(repeats):
        times = {}
        for checked in (False, True) if round_ % 2 == 0 else (True, False):
            check = ch.NanCheckHook().register_with_comm() if checked else None
            times[checked] = _per_call(fn, calls)
            if check is not None:
                check.unregister()
        added.append(times[True] - times[False])
    return added


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ch.instrument()
    torch.set_num_threads(1)
    hot_path = _instrumented(ch.OpName.all_reduce, _backend_returns_at_once, _all_reduce)
    finite_added: dict[str, float] = {}
    print(f"{'payload':<8}{'added on the hot path µs':>30}{'pass µs':>9}{'sum µs':>8}{'added / sum':>13}"
          f"{'gloo all_reduce µs':>20}{'added there µs':>16}")
    for name, nbytes in SIZES.items():
        t = torch.randn(nbytes // 4)
        calls = max(3, min(5000, (256 << 20) // nbytes))
        added = _added(lambda: hot_path(t), calls, args.repeats)
        one_pass = statistics.median(_per_call(lambda: tensor_finite(t), calls) for _ in range(args.repeats))
        one_sum = statistics.median(_per_call(lambda: torch.sum(t), calls) for _ in range(args.repeats))
        gloo = statistics.median(_per_call(lambda: dist.all_reduce(t), calls) for _ in range(args.repeats))
        in_gloo = statistics.median(_added(lambda: dist.all_reduce(t), calls, args.repeats))
        median = statistics.median(added)
        spread = f"{median * 1e6:.2f} ({min(added) * 1e6:.2f} - {max(added) * 1e6:.2f})"
        print(f"{name:<8}{spread:>30}{one_pass * 1e6:>9.2f}{one_sum * 1e6:>8.2f}{median / one_sum:>12.2f}x"
              f"{gloo * 1e6:>20.1f}{in_gloo * 1e6:>16.1f}", flush=True)
        finite_added[name] = median
    print(f"\n{'payload':<8}{'with one Inf: added on the hot path µs':>42}{'over the finite payload':>26}")
    for name, nbytes in SIZES.items():
        t = torch.randn(nbytes // 4)
        t[len(t) // 2] = float("inf")
        calls = max(3, min(5000, (256 << 20) // nbytes))
        added = _added(lambda: hot_path(t), calls, args.repeats)
        median = statistics.median(added)
        spread = f"{median * 1e6:.2f} ({min(added) * 1e6:.2f} - {max(added) * 1e6:.2f})"
        print(f"{name:<8}{spread:>42}{median / finite_added[name]:>25.2f}x", flush=True)
    ch.uninstrument()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
