"""Training-step time when the OTLP collector is down or never answers, against no commlens at all.

Two gloo ranks run the same training steps (a small matmul and a 64 KiB all_reduce) in rounds that
alternate between: commlens off; commlens writing spans to its embedded file sink (a healthy
exporter); commlens exporting to a port where nothing listens; commlens exporting to a collector that
accepts connections and never answers. Medians of per-step time in
the same run, and the spans each rank lost (counted, not hidden).

    python bench/dead_collector.py
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from commlens.agent.cli.ports import free_port

STEPS, ROUNDS = 200, 6


def _steps() -> float:
    weights, grads = torch.randn(128, 128), torch.zeros(16384)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(STEPS):
        weights = torch.tanh(weights @ weights) * 0.5
        dist.all_reduce(grads)
    return (time.perf_counter() - start) / STEPS * 1e6


def _rank(rank: int, port: int, endpoints: dict, out: dict) -> None:
    import commlens.agent
    from commlens.agent import Config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    times: dict[str, list[float]] = {mode: [] for mode in ("off", *endpoints)}
    lost = {}
    for _ in range(ROUNDS):
        times["off"].append(_steps())
        for mode, endpoint in endpoints.items():
            where = {"COMMLENS_TRACE_FILE": endpoint} if mode == "file sink" else \
                {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_TIMEOUT": "1000"}
            agent = commlens.agent.start(Config.from_env({
                "RANK": str(rank), "WORLD_SIZE": "2", "COMMLENS_METRICS_PORT": "0", **where}))
            times[mode].append(_steps())
            commlens.agent.stop()
            lost[mode] = lost.get(mode, 0) + agent.spans.counts["failed"] + agent.spans.counts["dropped"]
    if rank == 0:
        out.update({mode: statistics.median(values) for mode, values in times.items()})
        out.update({f"lost {mode}": n for mode, n in lost.items()})
    dist.destroy_process_group()


def main() -> int:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1024)
    with tempfile.TemporaryDirectory(prefix="commlens-bench-") as sink:
        endpoints = {"file sink": os.path.join(sink, "spans-{rank}.jsonl"),
                     "collector down": f"http://127.0.0.1:{free_port()}",
                     "collector silent": f"http://127.0.0.1:{silent.getsockname()[1]}"}
        with mp.Manager() as manager:
            out = manager.dict()
            mp.start_processes(_rank, args=(free_port(), endpoints, out), nprocs=2, start_method="spawn")
            out = dict(out)
        off = out["off"]
        print(f"training step, 2 gloo ranks: {off:.0f} µs without commlens")
        for mode in endpoints:
            print(f"  {mode}: {out[mode]:.0f} µs = {out[mode] / off:.3f}x; spans lost and counted: {out['lost ' + mode]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
