"""commlens on a GPU: added time per NCCL collective and per DDP training step.

A world of one on GPU 0 (NCCL). Arms, interleaved over ``--rounds`` rounds, medians with min – max:
no commlens, and commlens (``commlens.agent.start()``: GPU timing, the NaN/Inf check on the device,
sidecar and spans to a file) on

* ``all_reduce`` of 4 KiB and of 64 MiB (``--calls`` back to back, then one synchronisation);
* a DDP training step of a ~100M-parameter model (six 4096×4096 linear layers, batch 64), the plain
  model with DDP's built-in C++ allreduce, the other under commlens (its wrapped allreduce hook).

Goals: ≤ 2 % on the 64 MiB all_reduce, ≤ 1 % on the training step.

    python bench/gpu.py [--rounds 7] [--sample 0.01]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import commlens.agent
import commlens.hooks as ch
from commlens.agent.config import Config


def _timed(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(4096, 4096), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).cuda()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--sample", type=float, default=1.0,
                        help="share of spans exported (traceidratio; default 1: every collective's span)")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    plain_model = torch.nn.parallel.DistributedDataParallel(_model())
    spans = tempfile.TemporaryDirectory(prefix="commlens-gpu-")
    agent = commlens.agent.start(Config(metrics_port=None, trace_file=os.path.join(spans.name, "t.jsonl"),
                                        sampler="traceidratio", sampler_ratio=args.sample))
    traced_model = torch.nn.parallel.DistributedDataParallel(_model())
    optimizers = {id(m): torch.optim.SGD(m.parameters(), lr=1e-4) for m in (plain_model, traced_model)}
    x = torch.randn(64, 4096, device="cuda")
    small, large = torch.randn(1024, device="cuda"), torch.randn(16 << 20, device="cuda")

    def step(model):
        optimizer = optimizers[id(model)]
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    cases = {"all_reduce 4 KiB": (lambda: dist.all_reduce(small), args.calls),
             "all_reduce 64 MiB": (lambda: dist.all_reduce(large), args.calls // 4),
             "DDP step, 100M params": (None, 20)}
    times: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds + 1):  # the first round warms up and is not counted
        for arm in ("plain", "commlens"):
            if arm == "plain":
                ch.uninstrument()
                agent.nan_check.unregister()
            else:
                ch.instrument()
                agent.nan_check.register_with_comm()
            for name, (fn, calls) in cases.items():
                if fn is None:
                    fn = (lambda: step(plain_model)) if arm == "plain" else (lambda: step(traced_model))
                seconds = _timed(fn, calls)
                if round_:
                    times.setdefault((name, arm), []).append(seconds)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.rounds} rounds, "
          f"{args.sample:g} of spans exported")
    print(f"{'case':<24}{'plain µs':>12}{'commlens µs':>14}{'added µs':>11}{'ratio (min-max)':>24}")
    for name in cases:
        plain, traced = times[(name, "plain")], times[(name, "commlens")]
        ratios = [t / p for p, t in zip(plain, traced)]
        print(f"{name:<24}{statistics.median(plain) * 1e6:>12.1f}{statistics.median(traced) * 1e6:>14.1f}"
              f"{(statistics.median(traced) - statistics.median(plain)) * 1e6:>11.1f}"
              f"{statistics.median(ratios):>10.4f} ({min(ratios):.4f}-{max(ratios):.4f})")
    commlens.agent.stop()
    spans.cleanup()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
