"""What commlens adds to each collective, measured in one run against baselines of the same run.

1. Hot path: pre + post + START/END ring records around an all_reduce whose backend call returns
   at once, against the same call uninstrumented (no user hooks). Median over batches, µs per op.
2. A real 2-rank gloo all_reduce of 4 KiB, instrumented over uninstrumented.
3. One OpenTelemetry SDK span per op (BatchSpanProcessor, exporter that drops), for comparison.

    python bench/hook_overhead.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from commlens.agent.cli.ports import free_port
from commlens.hooks import OpName, instrument, uninstrument
from commlens.hooks.distributed import _all_reduce, _wrapper

BATCH, BATCHES = 2000, 30


def per_op_us(fn, *args) -> float:
    samples = []
    for _ in range(BATCHES):
        start = time.perf_counter_ns()
        for _ in range(BATCH):
            fn(*args)
        samples.append((time.perf_counter_ns() - start) / BATCH / 1000)
    return statistics.median(samples)


def hot_path() -> tuple[float, float]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    tensor = torch.ones(1024)

    def backend_returns_at_once(tensor, op=None, group=None, async_op=False):
        return None

    wrapped = _wrapper(OpName.all_reduce, backend_returns_at_once, _all_reduce, "collective")
    plain = per_op_us(backend_returns_at_once, tensor)
    recorded = per_op_us(wrapped, tensor)
    dist.destroy_process_group()
    return plain, recorded


def otel_span() -> float:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    tracer = provider.get_tracer("bench")

    def span(tensor):
        with tracer.start_as_current_span("all_reduce", attributes={"commlens.op": "all_reduce",
                                                                    "commlens.bytes": 4096}):
            pass

    cost = per_op_us(span, None)
    provider.shutdown()
    return cost


def _real_rank(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tensor = torch.ones(1024)  # 4 KiB
    timings = {"plain": [], "instrumented": []}
    for round_ in range(10):
        for mode in ("plain", "instrumented"):
            (instrument if mode == "instrumented" else uninstrument)()
            dist.barrier()
            start = time.perf_counter_ns()
            for _ in range(300):
                dist.all_reduce(tensor)
            timings[mode].append((time.perf_counter_ns() - start) / 300 / 1000)
    uninstrument()
    if rank == 0:
        out.update({mode: statistics.median(values) for mode, values in timings.items()})
    dist.destroy_process_group()


def real_all_reduce() -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_real_rank, args=(free_port(), out), nprocs=2, start_method="spawn")
        return dict(out)


def main() -> int:
    plain, recorded = hot_path()
    added = recorded - plain
    span = otel_span()
    real = real_all_reduce()
    print(f"hot path, no user hooks: {added:.2f} µs added per collective "
          f"(call {plain:.2f} µs plain, {recorded:.2f} µs recorded; goal <= 1.5 µs)")
    print(f"OpenTelemetry SDK span per op: {span:.2f} µs = {span / added:.1f}x commlens' added cost (goal >= 15x)")
    print(f"gloo all_reduce 4 KiB, 2 ranks: {real['plain']:.1f} µs plain, {real['instrumented']:.1f} µs "
          f"instrumented = {real['instrumented'] / real['plain']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
