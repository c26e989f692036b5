"""Where a collective's cost goes on the GPU path: ``torch.profiler``'s CPU operators and GPU kernels of
the training thread, per collective, for an all_reduce of 4 KiB and a DDP step (8 buckets), with
commlens (its default agent) and without. One GPU, a world of one on NCCL; what ``bench/gpu.py``'s
``no-nan-check`` and ``hooks-only`` configurations split in totals, this names.

    python bench/gpu_profile.py [--iterations 50] [--rows 18]
    python bench/gpu_profile.py --device cpu --iterations 2   # gloo on the CPU: the script's paths only
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu import _model, _start, _stop  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from ports import free_port  # noqa: E402


def _workloads(device: torch.device) -> dict:
    tensor = torch.zeros(1 << 10, device=device)
    model = _model(device, "DDP")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(2048 if device.type == "cuda" else 16, model.module[0].in_features, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        optimizer.step()
    return {"all_reduce 4 KiB": lambda: dist.all_reduce(tensor), "DDP step": step}


def _table(run, iterations: int, rows: int, title: str, device: torch.device) -> None:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(5):  # warm up: communicators, DDP's buckets, commlens' pools
        run()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for _ in range(iterations):
            run()
        sync()
    print(f"== {title}: per iteration, µs (of {iterations})")
    events = profiler.key_averages()
    print(f"{'self CPU':>10}{'calls':>8}  operator")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:rows]:
        print(f"{e.self_cpu_time_total / iterations:>10.1f}{e.count / iterations:>8.1f}  {e.key[:100]}")
    print(f"{'GPU':>10}{'calls':>8}  kernel or copy")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows // 2]:
        if e.self_device_time_total:
            print(f"{e.self_device_time_total / iterations:>10.1f}{e.count / iterations:>8.1f}  {e.key[:100]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--rows", type=int, default=18)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      COMMLENS_METRICS_PORT="0", COMMLENS_TRACE_FILE=os.devnull)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    plain = _workloads(device)
    nan_check = _start("default")
    traced = _workloads(device)
    for name in plain:
        _stop("default", nan_check)
        _table(plain[name], args.iterations, args.rows, f"{name}, without commlens", device)
        nan_check = _start("default")
        _table(traced[name], args.iterations, args.rows, f"{name}, with commlens (default)", device)
    _stop("default", nan_check)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
