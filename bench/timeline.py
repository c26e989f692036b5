"""What ``commlens timeline`` costs on a long job: seconds and peak memory for 1M collectives.

Writes the trace files of a job of 4 ranks that ran ``--collectives`` collectives (default 1,000,000
spans in all, as the exporter writes them: OTLP JSON lines of 64 spans), over 4 process groups, every
rank's clock a little off, then builds the timeline in a fresh process and reports its wall time,
peak resident memory and the size of the file it wrote.

    python bench/timeline.py [--collectives 1000000]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

from commlens.exporters.telemetry import Collective
from commlens.exporters.otlp import BatchSpanProcessor
from commlens.exporters.span_exporters import JsonLinesSpanExporter

RANKS, GROUPS = 4, 4


def write_job(folder: str, collectives: int) -> None:
    """Trace files of ``RANKS`` ranks, ``collectives`` spans in all; rank r's clock is r ms ahead."""
    per_rank = collectives // RANKS
    for rank in range(RANKS):
        exporter = BatchSpanProcessor(JsonLinesSpanExporter(os.path.join(folder, f"traces-rank{rank}.jsonl")),
                                {"service.name": "bench"}, job="bench", world_size=RANKS, queue_size=per_rank)
        generator = random.Random(rank)
        t = 10**18 + rank * 1_000_000
        for i in range(per_rank):
            pg, seq = str(i % GROUPS), i // GROUPS + 1
            start = t + generator.randrange(0, 50_000)
            exporter.queue(Collective("all_reduce", pg, RANKS, seq, False, i, rank, 4096, "Float", False, "ok",
                                      start, t + 100_000, 1e9, False, False, False, False))
            t += 200_000
        exporter.shutdown(600)
        assert exporter.counts["exported"] == per_rank, exporter.counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="commlens-timeline-") as folder:
        started = time.perf_counter()
        write_job(folder, args.collectives)
        size = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))
        print(f"trace files: {args.collectives:,} spans, {size / 2**20:.0f} MiB, written in "
              f"{time.perf_counter() - started:.0f} s")
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "commlens.agent.verdicts.timeline", folder], check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - started
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**10
        written = os.path.getsize(os.path.join(folder, "timeline.json"))
    print(f"timeline of {args.collectives:,} collectives: {seconds:.1f} s, peak {peak:.0f} MiB resident, "
          f"{written / 2**20:.0f} MiB written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
