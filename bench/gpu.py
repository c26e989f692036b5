"""commlens on a GPU: what the whole agent adds to NCCL collectives and training steps.

One GPU, a world of one on NCCL. Each configuration runs in a job of its own, which times every
workload without commlens and with it, interleaved round after round (the first round warms up and is
not counted): without = no agent and the hooks off, on models built before the agent started; with =
``commlens.agent.start()`` under the configuration, on the same models built again from the same seed.

Configurations: ``default`` (NaN/Inf check on the device, span budget, spans to a file),
``no-nan-check`` (the default without it: what the timing alone costs), ``check-1-in-4`` (DDP's buckets
checked on one step in four, ``COMMLENS_NAN_CHECK_EVERY=4``), ``hooks-only`` (the hooks and
the NaN check, no agent and so no thread of commlens': the bench polls the GPU's events between slices;
the hot path's cost without the agent's threads competing for the GIL), ``every-span``
(``OTEL_TRACES_SAMPLER=always_on``), ``pod-sidecar`` (the rank writes its ring only; ``commlens
sidecar``, a process of its own, drains it). Workloads: all_reduce of 4 KiB and of 64 MiB; a DDP step
and an FSDP2 step of ``LAYERS`` Linear(``WIDTH``) layers on a batch of ``BATCH`` (TF32 matmuls),
big enough that the step is not bound by kernel launches alone.

Per workload and configuration: the plain step's wall time and its training thread's CPU (torch's own
cost: the floor); the step ratio (with over without, paired by round) min - median - max; the training
thread's CPU until the slice is issued (``time.thread_time``) and the GPU's time
(CUDA events around the slice queued behind a spinning kernel, so that it runs back to back: busy
time, not time spent waiting for the CPU) added per collective; the plain step time. The queue of
launches CUDA holds bounds the iterations per slice. Then the NaN/Inf check's GPU time on the
64 MiB payload (the check on against off, same job) beside one ``torch.sum`` over it: the goal is at
most 1.2x.

    python bench/gpu.py [--rounds 5] [--configs default no-nan-check check-1-in-4 hooks-only every-span pod-sidecar] [--workloads ...]
    python bench/gpu.py --device cpu --rounds 1   # gloo on the CPU: every path, no figure of worth
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import commlens.agent
import commlens.hooks as ch
from commlens.hooks import cuda

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from ports import free_port  # noqa: E402

CONFIGS = {"default": {}, "no-nan-check": {"COMMLENS_NAN_CHECK": "off"}, "check-1-in-4": {"COMMLENS_NAN_CHECK_EVERY": "4"},
           "hooks-only": {},
           "every-span": {"OTEL_TRACES_SAMPLER": "always_on"}, "pod-sidecar": {}}
LAYERS, WIDTH, BATCH = 8, 4096, 2048
WORKLOADS = {"all_reduce 4 KiB": (1 << 10, 100), "all_reduce 64 MiB": (1 << 24, 40),
             "DDP step": (None, 10), "FSDP2 step": (None, 10)}
"""Name: (float32 elements of the payload, or None for a training step; iterations per slice)."""


def _model(device: torch.device, wrapper: str) -> torch.nn.Module:
    torch.manual_seed(0)
    width = WIDTH if device.type == "cuda" else 256
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(LAYERS)]).to(device)
    if wrapper == "DDP":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def _step(name: str, device: torch.device):
    """One iteration of workload ``name`` as a function (a fresh model for a training step)."""
    elements, _ = WORKLOADS[name]
    if elements is not None:
        tensor = torch.zeros(elements, device=device)
        return lambda: dist.all_reduce(tensor)
    model = _model(device, name.split()[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(BATCH if device.type == "cuda" else 16, model.module[0].in_features if hasattr(model, "module")
                    else model[0].in_features, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        optimizer.step()
    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _slice(step, iterations: int, device: torch.device) -> dict:
    """Per iteration: wall seconds, and the training thread's CPU seconds until the last one was
    issued (not the wait for the GPU after it, which spins); the collectives issued."""
    group = dist.distributed_c10d._get_default_group()
    _sync(device)
    seq, cpu, wall = group._get_sequence_number_for_group(), time.thread_time(), time.perf_counter()
    for _ in range(iterations):
        step()
    cpu = time.thread_time() - cpu
    _sync(device)
    wall = time.perf_counter() - wall
    return {"wall": wall / iterations, "cpu": cpu / iterations,
            "collectives": (group._get_sequence_number_for_group() - seq) / iterations}


def _gpu_busy_s(step, iterations: int, ahead_s: float) -> float:
    """GPU seconds per iteration with the GPU never waiting for the CPU: the slice is queued behind a
    kernel that spins for ``ahead_s`` (longer than the CPU takes to issue it), so that its work runs
    back to back between the two events."""
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    torch.cuda._sleep(int(ahead_s * _cycles_per_s()))
    events[0].record()
    for _ in range(iterations):
        step()
    events[1].record()
    torch.cuda.synchronize()
    return events[0].elapsed_time(events[1]) / 1e3 / iterations


@functools.cache
def _cycles_per_s() -> float:
    """The GPU clock's cycles per second, as ``torch.cuda._sleep`` counts them."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    torch.cuda._sleep(1 << 20)  # clocks up
    events[0].record()
    torch.cuda._sleep(1 << 26)
    events[1].record()
    torch.cuda.synchronize()
    return (1 << 26) / (events[0].elapsed_time(events[1]) / 1e3)


def _median_slice(step, iterations: int, device: torch.device) -> dict:
    slices = [_slice(step, iterations, device) for _ in range(3)]
    found = {key: statistics.median(s[key] for s in slices) for key in slices[0]}
    found["gpu"] = _gpu_busy_s(step, iterations, 2 * found["wall"] * iterations) if device.type == "cuda" else 0.0
    return found


def job(config: str, rounds: int, workloads: list[str], device_name: str) -> dict:
    """Every workload without and with commlens under ``config``, ``rounds`` + 1 interleaved rounds."""
    device = torch.device(device_name, 0) if device_name == "cuda" else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    folder = tempfile.mkdtemp(prefix="commlens-gpu-")
    os.environ.update(COMMLENS_METRICS_PORT="0", COMMLENS_TRACE_FILE=os.path.join(folder, "spans.jsonl"),
                      **CONFIGS[config])
    sidecar = None
    if config == "pod-sidecar":
        os.environ["COMMLENS_RING_DIR"] = folder
        sidecar = subprocess.Popen([sys.executable, "-m", "commlens.agent.cli", "sidecar", "--ring-dir", folder,
                                    "--metrics-port", "0", "--trace-file", os.path.join(folder, "pod.jsonl")],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in sidecar.stdout:  # until it says it started
            print(line, end="", file=sys.stderr)
            if line.startswith("commlens sidecar:"):
                break
    plain = {name: _step(name, device) for name in workloads}
    nan_check = _start(config)
    traced = {name: _step(name, device) for name in workloads}
    results: dict[str, dict[str, list[dict]]] = {name: {"none": [], "commlens": []} for name in workloads}
    check = {"on": [], "off": [], "sum": []}
    for round_ in range(rounds + 1):
        for name in workloads:
            iterations = WORKLOADS[name][1] if device.type == "cuda" else 2
            _stop(config, nan_check)
            none = _median_slice(plain[name], iterations, device)
            nan_check = _start(config)
            with_ = _median_slice(traced[name], iterations, device)
            if round_:
                results[name]["none"].append(none)
                results[name]["commlens"].append(with_)
            if round_ and name == "all_reduce 64 MiB" and nan_check is not None and device.type == "cuda":
                check["on"].append(with_["gpu"])
                nan_check.unregister()
                check["off"].append(_median_slice(traced[name], iterations, device)["gpu"])
                nan_check.register_with_comm()
                payload = torch.zeros(WORKLOADS[name][0], device=device)
                check["sum"].append(_gpu_busy_s(lambda: torch.sum(payload), iterations, with_["wall"] * iterations))
    _stop(config, nan_check)
    if sidecar is not None:
        sidecar.terminate()
        sidecar.wait(30)
    dist.destroy_process_group()
    return {"results": results, "check": check}


def _start(config: str) -> Any:
    """commlens under ``config``: the agent, or (``hooks-only``) the hooks and a NaN check of its own;
    returns the NaN check (None where it is off)."""
    if config != "hooks-only":
        return commlens.agent.start().nan_check
    ch.instrument()
    return ch.NanCheckHook().register_with_comm()


def _stop(config: str, nan_check: Any) -> None:
    """commlens stopped, as ``_start`` started it: the hooks off, the GPU's finished events given back."""
    if config == "hooks-only" and nan_check is not None:
        nan_check.unregister()
    commlens.agent.stop()  # none under hooks-only: nothing to stop
    ch.uninstrument()
    cuda.poll()


def _spread(values: list[float]) -> str:
    values = sorted(values)
    return f"{values[0]:.3f} - {statistics.median(values):.3f} - {values[-1]:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--job", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        print(json.dumps(job(args.job, args.rounds, args.workloads, args.device)))
        return 0
    jobs = {}
    for config in args.configs:
        print(f"job: {config}", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, __file__, "--job", config, "--rounds", str(args.rounds), "--device",
                              args.device, "--workloads", *args.workloads], stdout=subprocess.PIPE, text=True,
                             check=True)
        jobs[config] = json.loads(out.stdout.strip().splitlines()[-1])
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}; {args.rounds} rounds")
    print(f"model: {LAYERS} x Linear({WIDTH}), {LAYERS * (WIDTH * WIDTH + WIDTH) / 1e6:.0f}M parameters, batch {BATCH}")
    print(f"{'workload':<20}{'config':<13}{'plain ms':>10}{'plain CPU µs':>13}{'ratio min - median - max':>26}"
          f"{'coll./it':>9}{'+CPU µs/coll.':>14}{'+GPU µs/coll.':>14}")
    for name in args.workloads:
        for config, found in jobs.items():
            none, with_ = found["results"][name]["none"], found["results"][name]["commlens"]
            collectives = statistics.median(w["collectives"] for w in with_) or 1
            added = {key: statistics.median((w[key] - n[key]) / collectives * 1e6 for w, n in zip(with_, none))
                     for key in ("cpu", "gpu")}
            # a space before each figure: a column wider than its heading (a ratio of 100 or more) stays apart
            print(f"{name:<20}{config:<13}{statistics.median(n['wall'] for n in none) * 1e3:>10.3f} "
                  f"{statistics.median(n['cpu'] for n in none) * 1e6:>12.1f} "
                  f"{_spread([w['wall'] / n['wall'] for w, n in zip(with_, none)]):>25} {collectives:>8.1f} "
                  f"{added['cpu']:>13.1f} {added['gpu']:>13.1f}")
    for config, found in jobs.items():
        check = found["check"]
        if check["on"]:
            cost, one_sum = statistics.median(check["on"]) - statistics.median(check["off"]), statistics.median(check["sum"])
            print(f"NaN/Inf check ({config}), 64 MiB: +{cost * 1e6:.1f} µs of GPU per collective; one torch.sum: "
                  f"{one_sum * 1e6:.1f} µs; ratio {cost / one_sum:.2f} (goal <= 1.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
