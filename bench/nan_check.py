"""The NaN/Inf check's cost per collective against payload size, and against one ``torch.sum``.

The check is one reduction over each input (a finite sum proves every element finite; only a
non-finite sum is checked element by element). Measured on a world-size-1 gloo group, all hooks
instrumented in both arms: all_reduce with ``NanCheckHook`` against all_reduce with a pre-hook that
does nothing; beside it, one ``torch.sum`` of the same tensor, the check's floor (issue goal: the
check adds at most 1.2× a sum). Medians of ``--repeats`` interleaved rounds.

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

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}


def _per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ch.instrument()
    torch.set_num_threads(1)
    print(f"{'payload':<8}{'all_reduce µs':>14}{'+ check µs':>12}{'sum µs':>10}{'check / sum':>13}")
    for name, nbytes in SIZES.items():
        t = torch.randn(nbytes // 4)
        calls = max(3, min(2000, (256 << 20) // nbytes))
        plain, checked, sums = [], [], []
        for _ in range(args.repeats):
            handle = ch.register_pre_hook(lambda a: None)
            plain.append(_per_call(lambda: dist.all_reduce(t), calls))
            handle.remove()
            check = ch.NanCheckHook().register_with_comm()
            checked.append(_per_call(lambda: dist.all_reduce(t), calls))
            check.unregister()
            sums.append(_per_call(lambda: t.sum(), calls))
        base, with_check, total = (statistics.median(x) * 1e6 for x in (plain, checked, sums))
        added = with_check - base
        print(f"{name:<8}{base:>14.1f}{added:>12.1f}{total:>10.1f}{added / total:>12.2f}x", flush=True)
    ch.uninstrument()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
