"""The sidecar's drain, alone: CPU µs per collective to read, join and count what the hooks wrote.

A ring is filled with the records of synchronous all_reduces (START, END; on a GPU: START, GPU_START,
END), 30 or 300 at a time, as the hooks write them between two drains (50 ms: about 30 collectives of 4 KiB on gloo,
300 of a few bytes); each drain is timed on the CPU clock of this thread. Spans: sampled out, or
the default span budget (100 a second) decides for each collective, timed after its first second
(from then on a ratio: at this rate, a hash per collective), and those it keeps are dropped. The
in-process agent and the pod sidecar run this same loop.

    python bench/drain.py [--collectives 200000]
"""

from __future__ import annotations

import argparse
import time

from commlens.agent.config import Config
from commlens.agent.outputs import span_processor
from commlens.agent.sidecar import Sidecar
from commlens.hooks import record
from commlens.ring import codec
from commlens.ring.memory import Ring
from commlens.ring.ops import OpName
from commlens.ring.ops import CODE


def drain_us(collectives: int, per_drain: int, budget: bool, gpu: bool = False) -> float:
    """CPU µs per collective of ``Sidecar.drain`` over ``collectives`` all_reduces of 4 KiB (``gpu``:
    each timed on a GPU, its GPU_START 0.2 ms after issue)."""
    ring = Ring(slots=1 << 16)
    group = ring.intern(codec.encode_group("0", "default", [0, 1], 0, "gloo"))
    sig = ring.intern(codec.encode_signature([([1024], "Float")], [([1024], "Float")]))
    code = CODE[OpName.all_reduce]
    kept = []
    sample = (lambda pg, seqs, is_p2p: [])
    if budget:
        spans = span_processor(Config.from_env({"COMMLENS_TRACE_FILE": "/dev/null"}))
        sample = spans.sampled
    sidecar = Sidecar(ring, 0, 60, on_collective=kept.append, sample=sample)
    spent, op_id, drains = 0, 0, collectives // per_drain
    warm_until = time.monotonic() + (1.2 if budget else 0)  # past the budget's first window: a ratio from then on
    while drains:
        now = time.monotonic_ns()
        for _ in range(per_drain):
            op_id += 1
            record.start(ring.write, code, group, op_id, op_id, 4096, sig, -1, t_ns=now)
            if gpu:
                record.end_on_gpu(ring.write, code, group, op_id, op_id, 4096, sig, -1, 0, 0, now + 200_000,
                                  now + 1_500_000)
            else:
                record.end(ring.write, code, group, op_id, op_id, 4096, sig, -1, t_ns=now + 1_500_000)
        started = time.thread_time_ns()
        sidecar.drain()
        if now / 1e9 >= warm_until:
            spent += time.thread_time_ns() - started
            drains -= 1
        kept.clear()
    return spent / 1e3 / (collectives // per_drain * per_drain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", type=int, default=200_000)
    args = parser.parse_args()
    print(f"{'per drain':>10} {'timed on':>9} {'spans sampled out':>18} {'default span budget':>20}   "
          "(CPU µs per collective)")
    for gpu in (False, True):
        for per_drain in (30, 300):
            print(f"{per_drain:>10} {'GPU' if gpu else 'CPU':>9} {drain_us(args.collectives, per_drain, False, gpu):>18.2f} "
                  f"{drain_us(args.collectives, per_drain, True, gpu):>20.2f}")


if __name__ == "__main__":
    main()
