"""How long the training thread waits for the GIL while commlens' threads work beside it.

A thread that stands for training writes the records of 3 synchronous all_reduces into a ring, then
sleeps 200 µs, as it would in a collective that lets go of the GIL, over and over. Each wake-up's
delay beyond the 200 µs is how long it waited to run Python again: the operating system's wake-up,
plus any stretch for which a commlens thread held the GIL. Each configuration runs in a fresh
process, with the agent's threads as it runs them in the training process (``beside_training``):
``none`` (no commlens thread: the wake-up alone), ``sidecar`` (the drain, every span sampled out),
``default`` (the drain and the default span budget, spans to a trace file) and ``every-span``
(every collective's span built and written). Percentiles of the delay, in µs.

    python bench/gil_hold.py [--seconds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = ("none", "sidecar", "default", "every-span")
SLEEP_S = 200e-6


def delays_us(config: str, seconds: float, trace_file: str) -> tuple[list[float], float]:
    """The training thread's wake-up delays under ``config``, and the collectives a second it wrote."""
    from commlens.agent.config import Config
    from commlens.agent.outputs import span_processor
    from commlens.agent.sidecar import Sidecar
    from commlens.ring.ops import OpName
    from commlens.hooks import record
    from commlens.ring import codec
    from commlens.ring.ops import CODE
    from commlens.ring.memory import Ring

    ring = Ring(slots=1 << 16)
    group = ring.intern(codec.encode_group("0", "default", [0, 1], 0, "gloo"))
    sig = ring.intern(codec.encode_signature([([1024], "Float")], [([1024], "Float")]))
    code = CODE[OpName.all_reduce]
    sidecar = spans = None
    if config == "sidecar":
        sidecar = Sidecar(ring, 0, 60, sample=lambda pg, seqs, is_p2p: [], beside_training=True)
    elif config != "none":
        env = {"COMMLENS_TRACE_FILE": trace_file, **({"OTEL_TRACES_SAMPLER": "always_on"} if config == "every-span" else {})}
        spans = span_processor(Config.from_env(env), beside_training=True)
        sidecar = Sidecar(ring, 0, 60, on_collective=spans.queue, sample=spans.sampled, beside_training=True)
    if sidecar is not None:
        sidecar.start(0.05)
    delays, op_id, until = [], 0, time.monotonic() + seconds
    while time.monotonic() < until:
        for _ in range(3):
            op_id += 1
            now = time.monotonic_ns()
            record.start(ring.write, code, group, op_id, op_id, 4096, sig, -1, t_ns=now)
            record.end(ring.write, code, group, op_id, op_id, 4096, sig, -1, t_ns=now + 30_000)
        started = time.perf_counter()
        time.sleep(SLEEP_S)
        delays.append((time.perf_counter() - started - SLEEP_S) * 1e6)
    if sidecar is not None:
        sidecar.stop()
    if spans is not None:
        spans.shutdown(5)
    return delays, op_id / seconds


def _percentile(values: list[float], p: float) -> float:
    return values[round(p * (len(values) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)  # a fresh process's own run
    args = parser.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory() as folder:
            delays, rate = delays_us(args.one, args.seconds, os.path.join(folder, "traces.jsonl"))
        print(json.dumps({"delays": sorted(delays), "rate": rate}))
        return 0
    print(f"{'config':<12}{'collectives/s':>14}{'p50':>8}{'p99':>8}{'p99.9':>8}{'max':>8}   "
          "(µs the training thread waited past its 200 µs sleep)")
    for config in CONFIGS:
        done = subprocess.run([sys.executable, __file__, "--seconds", str(args.seconds), "--one", config],
                              capture_output=True, text=True, check=True)
        result = json.loads(done.stdout)
        delays = result["delays"]
        print(f"{config:<12}{result['rate']:>14.0f}" + "".join(f"{_percentile(delays, p):>8.0f}"
                                                             for p in (0.5, 0.99, 0.999, 1.0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
