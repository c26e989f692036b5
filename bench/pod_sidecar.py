"""The pod sidecar against the in-process thread, in one run.

1. Cost on the training process: a 1-rank gloo job issues 100k all_reduce of 1 KiB, once with no
   commlens, once with commlens exporting from a thread of the process (the default), once with the
   ranks' hot path only and ``commlens sidecar`` in its own process (``COMMLENS_RING_DIR``). Reported:
   CPU seconds of the training process (every thread: getrusage) per 100k collectives, and what each
   mode adds over no commlens; the pod sidecar's own CPU seconds beside it. Modes alternate, ``--rounds``
   times; medians.
2. Drain throughput: 8 rings filled by writers beforehand (``--slots`` records each, as START/END
   pairs 100 µs long), drained by one ``PodSidecar`` pinned to one core, spans to a file: every span
   (``OTEL_TRACES_SAMPLER=parentbased_always_on``), the default span budget, no span
   (``always_off``). Records per second; goal >= 300k.

    python bench/pod_sidecar.py [--collectives 100000] [--rounds 3] [--slots 65536]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("none", "thread", "pod")
RANKS = 8
SAMPLERS = {"every span": "parentbased_always_on", "the span budget": None, "no span": "always_off"}
"""The span samplers compared; None: the default, ``COMMLENS_SPAN_BUDGET`` spans a second per rank."""


def worker(mode: str, collectives: int) -> dict:
    """One training process: ``collectives`` all_reduce of 1 KiB; its CPU seconds while issuing them."""
    import torch
    import torch.distributed as dist

    from commlens.agent.cli.ports import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    if mode != "none":
        import commlens.agent

        commlens.agent.start()
    tensor = torch.ones(256)
    for _ in range(1000):  # warm-up
        dist.all_reduce(tensor)
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(collectives):
        dist.all_reduce(tensor)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - started
    if mode != "none":
        import commlens.agent

        commlens.agent.stop()
    dist.destroy_process_group()
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"cpu_s": cpu, "wall_s": wall}


def run_mode(mode: str, collectives: int, folder: str) -> dict:
    env = {**os.environ, "COMMLENS_METRICS_PORT": "0", "COMMLENS_TRACE_FILE": os.path.join(folder, "traces-{rank}.jsonl")}
    env.pop("COMMLENS_RING_DIR", None)
    sidecar = None
    if mode == "pod":
        rings = tempfile.mkdtemp(dir=folder)
        env["COMMLENS_RING_DIR"] = rings
        sidecar = subprocess.Popen([sys.executable, "-m", "commlens.agent.cli", "sidecar"], env=env,
                                   stdout=subprocess.DEVNULL)
    done = subprocess.run([sys.executable, __file__, "--worker", mode, "--collectives", str(collectives)],
                          env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if sidecar is not None:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(60)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        result["sidecar_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return result


def cost(collectives: int, rounds: int) -> None:
    found: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(rounds):
            for mode in MODES:
                found[mode].append(run_mode(mode, collectives, folder))
    per_100k = 100_000 / collectives
    cpu = {mode: statistics.median(r["cpu_s"] for r in found[mode]) * per_100k for mode in MODES}
    wall = {mode: statistics.median(r["wall_s"] for r in found[mode]) * per_100k for mode in MODES}
    print(f"1. training process, {collectives} x all_reduce 1 KiB (1-rank gloo), median of {rounds} rounds:")
    for mode in MODES:
        added = cpu[mode] - cpu["none"]
        print(f"   {mode:>6}: {cpu[mode]:6.2f} CPU s per 100k collectives ({added * 10:+6.2f} µs per collective over "
              f"none), wall {wall[mode]:6.2f} s ({wall[mode] / wall['none']:.3f}x)")
    sidecar_cpu = statistics.median(r["sidecar_cpu_s"] for r in found["pod"]) * per_100k
    print(f"   the pod sidecar process itself: {sidecar_cpu:.2f} CPU s per 100k collectives (start-up included)")


def drain(slots: int) -> None:
    from commlens.agent.config import Config
    from commlens.agent.pod import PodSidecar
    from commlens.hooks import record
    from commlens.ring import codec
    from commlens.ring.memory import Ring, ring_file

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    print(f"2. drain: {RANKS} rings x {slots} records, one PodSidecar on one core:")
    for label, sampler in SAMPLERS.items():
        with tempfile.TemporaryDirectory() as folder:
            rings = []
            for rank in range(RANKS):
                ring = Ring(slots=slots, path=ring_file(folder, rank))
                ring.describe({"rank": rank, "local_rank": rank, "world_size": RANKS, "job": "bench"})
                group = ring.intern(codec.encode_group("0", "default_pg", list(range(RANKS)), rank, "gloo"))
                sig = ring.intern(codec.encode_signature([([256], "Float")], [([256], "Float")]))
                began = time.monotonic_ns()
                for op_id in range(1, slots // 2 + 1):
                    t_ns = began + op_id * 1_000_000
                    record.start(ring.write, 0, group, op_id, op_id, 1024, sig, -1, t_ns=t_ns)
                    record.end(ring.write, 0, group, op_id, op_id, 1024, sig, -1, t_ns=t_ns + 100_000)
                rings.append(ring)
            config = dataclasses.replace(Config.from_env({"OTEL_TRACES_SAMPLER": sampler} if sampler else {}),
                                         metrics_port=None,
                                         trace_file=os.path.join(folder, "traces-{rank}.jsonl"))
            pod = PodSidecar(config, folder)
            started = time.perf_counter()
            pod.poll()
            while any(feed.sidecar.reader.cursor < slots for feed in pod.feeds.values()) or len(pod.feeds) < RANKS:
                pod.poll()
            seconds = time.perf_counter() - started
            dropped = sum(feed.sidecar.reader.dropped for feed in pod.feeds.values())
            pod.stop(timeout_s=30)
            total = RANKS * slots
            print(f"   {label:>15}: {total / seconds / 1e3:6.0f}k records/s ({total} records in "
                  f"{seconds:.2f} s, {dropped} dropped)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--collectives", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=65536)
    parser.add_argument("--worker", choices=MODES)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.collectives)))
        return
    cost(args.collectives, args.rounds)
    drain(args.slots)


if __name__ == "__main__":
    main()
