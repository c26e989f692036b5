"""The whole agent's cost on the training process: each configuration against no commlens, in one run.

Every trial is a fresh 2-rank gloo job on CPU (its ranks forked from a server that imported torch
once) that runs one workload under one configuration; trials are interleaved (every configuration
of a workload, then the next workload, repeat after repeat), and each configuration's time is
divided by the no-commlens trial of the same workload and repeat. The table gives the paired
ratios' min - median - max. Beside it, from the same trials, the CPU rank 0's process used per
iteration (all its threads, to the ns: ``/proc/<pid>/task/*/schedstat``) over the
no-commlens trial of its repeat, and what commlens' own threads used: steadier than wall time here,
where two jobs without commlens differ by up to 20 %. The CPU that commlens itself uses per collective
comes from one-rank jobs that run ``--cpu-collectives`` all_reduces of 4 KiB (100,000, and a tenth
more to warm up), ``--cpu-repeats`` per configuration, interleaved, divided by the collectives each
counted: its threads in the training process (by native thread id), the training thread's extra CPU
over the no-commlens job of the same repeat, and the pod sidecar's process apart; medians. A CPU
job's process runs on one core: across two, gloo's hand-off to its own thread costs the training
thread 2-3x as much per collective and varies by +-10 µs from one job to the next
(``bench/hot_path_loop.py --no-pin``). Beside
them a yardstick without commlens: each all_reduce preceded by 1.2 µs of plain Python, the hooks' own
cost, to show what that much work on the training thread costs it there. The NaN/Inf check's cost is timed within
each default trial of an all_reduce (slices with and without it, alternated), beside one ``torch.sum``
over the same payload, its goal's yardstick (at most 1.2x that).

Last, what the agent costs a job between collectives: the CPU its threads use per second in a
one-rank job that issues none (``--idle-s``).

Configurations: ``none``; ``none-again`` (a second job without commlens, paired like the others:
its ratio, and its CPU over ``none``, are this machine's noise, the resolution of every other row);
``default`` (``commlens.agent.start()``: NaN/Inf check, span budget, spans to
the trace file); ``no-nan-check`` (the default with ``COMMLENS_NAN_CHECK=off``); ``every-span``
(``OTEL_TRACES_SAMPLER=always_on``); ``pod-sidecar`` (the ranks write rings only; ``commlens sidecar``,
a process of its own, drains them). Workloads: all_reduce of 4 KiB, 1 MiB and 64 MiB, a DDP step
(3 x Linear(1024), batch 64) and an FSDP2 step of the same model.

    python bench/agent_cost.py --repeats 5       # the figures (about 15 minutes on 2 cores)
    python bench/agent_cost.py --quick           # every path once, briefly (CI: no timing judged)
    python bench/agent_cost.py --payload inf     # every collective holding Inf: the non-finite path
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
# ports drawn from the pytest-xdist worker's own slice when a test runs this (the whole range otherwise): a
# port chosen here must not be one another worker's test has chosen and not bound yet
from ports import free_port, free_ports  # noqa: E402

CONFIGS = {
    "none": None,
    "none-again": None,  # a second job without commlens: its ratio is the pairing's own noise
    "default": {},
    "no-nan-check": {"COMMLENS_NAN_CHECK": "off"},
    "every-span": {"OTEL_TRACES_SAMPLER": "always_on"},
    "pod-sidecar": {"COMMLENS_RING_DIR": ""},  # filled in per trial
}
TRIAL_LIMIT_S = 240
YARDSTICK_US = 1.2
"""The CPU jobs' yardstick (no commlens): each all_reduce preceded by this much plain Python, what the
hooks cost on their own (``bench/hook_overhead.py``). What it adds to the training thread is what any
such work before a collective costs there, gloo's hand-off to its own thread included."""
YARDSTICK = f"python-{YARDSTICK_US}us"
WORKLOADS = {"all_reduce 4 KiB": (1 << 10, 2000), "all_reduce 1 MiB": (1 << 18, 400),
             "all_reduce 64 MiB": (1 << 24, 12), "DDP step": (None, 60), "FSDP2 step": (None, 40)}
"""Name: (float32 elements of the payload, or None for a training step; iterations timed)."""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)])


def _busy(us: float):
    """A function that spends about ``us`` µs of CPU in plain Python, calibrated on itself."""
    spins = range(100)

    def busy() -> None:
        for _ in spins:
            pass

    calls, started = 20_000, time.thread_time()
    for _ in range(calls):
        busy()
    per_call_us = (time.thread_time() - started) / calls * 1e6
    spins = range(max(1, round(100 * us / per_call_us)))
    return busy


def workload_step(name: str, busy_us: float = 0.0, fill: float = 0.0):
    """One iteration of workload ``name``, as a function; an all_reduce preceded by ``busy_us`` of Python,
    of a payload of ``fill`` (zeros: a summed payload of ones would double each time, and be Inf after
    128 collectives; Inf stays Inf: every collective a NaN/Inf event)."""
    elements, _ = WORKLOADS[name]
    if elements is not None:
        tensor = torch.full((elements,), fill)
        if busy_us:
            busy = _busy(busy_us)
            return lambda: (busy(), dist.all_reduce(tensor))
        return lambda: dist.all_reduce(tensor)
    model = _model()
    if name.startswith("DDP"):
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024)

    def step() -> None:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return step


def _slice_s(step, iterations: int) -> float:
    """Seconds per iteration over ``iterations`` of ``step``."""
    started = time.perf_counter()
    for _ in range(iterations):
        step()
    return (time.perf_counter() - started) / iterations


def _workload(step, iterations: int) -> float:
    """Seconds per iteration (median of 5 slices of ``iterations``, after a warm-up)."""
    for _ in range(max(3, iterations // 10)):  # warm-up
        step()
    dist.barrier()
    return statistics.median(_slice_s(step, max(1, iterations // 5)) for _ in range(5))


def _iterations_run(iterations: int) -> int:
    """Iterations ``_workload(step, iterations)`` runs, warm-up included."""
    return max(3, iterations // 10) + 5 * max(1, iterations // 5)


def _check_cost_s(check, step, iterations: int) -> float:
    """Seconds the NaN/Inf check adds per iteration, within one trial: slices with it and without it
    alternate, in the order ABBA (every rank toggles its own at the same collective), median minus
    median."""
    checked, unchecked, per_slice, registered = [], [], max(1, iterations // 5), True
    for order in range(6):
        for on in (True, False) if order % 2 == 0 else (False, True):
            if on != registered:
                check.register_with_comm() if on else check.unregister()
                registered = on
            (checked if on else unchecked).append(_slice_s(step, per_slice))
    if not registered:
        check.register_with_comm()
    return statistics.median(checked) - statistics.median(unchecked)


def _task_cpu_s(task: str) -> float:
    """Seconds a thread has run on a CPU, to the ns (``/proc/<pid>/task/<tid>/schedstat``; the
    ``stat`` file's ticks are 10 ms); 0 for a thread that has ended."""
    try:
        with open(f"{task}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except FileNotFoundError:
        return 0.0


def _thread_cpu_s(native_id: int) -> float:
    return _task_cpu_s(f"/proc/self/task/{native_id}")


def _process_cpu_s(pid: int) -> float:
    """Seconds the threads of process ``pid`` alive now have run."""
    return sum(_task_cpu_s(f"/proc/{pid}/task/{tid}") for tid in os.listdir(f"/proc/{pid}/task"))


def _trial(rank: int, world_size: int, port: int, workload: str, iterations: int, settings: dict | None,
           out: dict, busy_us: float = 0.0, fill: float = 0.0) -> None:
    # a rank still running after TRIAL_LIMIT_S (a trial takes seconds) prints every thread's stack and
    # exits, so that a hang, wherever it is (training, commlens, the process' exit), fails with its evidence
    faulthandler.dump_traceback_later(TRIAL_LIMIT_S, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    if world_size == 1:  # the CPU jobs: on one core, where gloo's hand-offs cost the same from job to job
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    agent = None
    if settings is not None:
        import commlens.agent

        os.environ.update(settings)
        agent = commlens.agent.start()
    main_thread, group = threading.main_thread().native_id, dist.distributed_c10d._get_default_group()
    step = workload_step(workload, busy_us, fill)
    before = {t.native_id: _thread_cpu_s(t.native_id) for t in threading.enumerate()}
    first_seq, process_before = group._get_sequence_number_for_group(), time.process_time()
    seconds = _workload(step, iterations)
    process_cpu_s = time.process_time() - process_before  # every thread of this rank, warm-up included
    collectives = group._get_sequence_number_for_group() - first_seq  # warm-up included, as in the CPU figures
    threads = {t.native_id: t.name for t in threading.enumerate()}
    spent = {name: _thread_cpu_s(tid) - before.get(tid, 0.0) for tid, name in threads.items()}
    training = spent.pop(threads[main_thread])
    commlens_threads = sum(s for name, s in spent.items() if name.startswith("commlens"))
    sum_s = check_s = None
    elements = WORKLOADS[workload][0]
    if elements is not None and agent is not None and agent.nan_check is not None and world_size > 1:
        check_s = _check_cost_s(agent.nan_check, step, iterations)
    if elements is not None:  # the NaN check's yardstick: one pass over the same payload
        tensor = torch.ones(elements)
        started = time.perf_counter()
        for _ in range(20):
            torch.sum(tensor)
        sum_s = (time.perf_counter() - started) / 20
    if agent is not None:
        import commlens.agent

        commlens.agent.stop()
    if rank == 0:
        out["result"] = {"seconds": seconds, "collectives": collectives, "training_cpu_s": training,
                         "commlens_cpu_s": commlens_threads, "process_cpu_s": process_cpu_s,
                         "iterations": _iterations_run(iterations), "sum_s": sum_s, "check_s": check_s}
    # the model (its DDP reducer, in reference cycles) and the group freed while the group is whole: in
    # one CI run, a rank of "DDP step, none" left to the garbage collector after the group's destruction
    # hung there, after its trial had returned, until the trial limit
    del step, group
    gc.collect()
    dist.destroy_process_group()


def _idle(rank: int, port: int, seconds: float, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      COMMLENS_METRICS_PORT="0", COMMLENS_TRACE_FILE=os.devnull)
    dist.init_process_group("gloo", rank=0, world_size=1)
    import commlens.agent

    commlens.agent.start()
    threads = [t.native_id for t in threading.enumerate() if t.name.startswith("commlens")]
    before = sum(_thread_cpu_s(tid) for tid in threads)
    time.sleep(seconds)  # what is measured: the agent's threads while the job issues no collective
    out["idle_cpu_s"] = (sum(_thread_cpu_s(tid) for tid in threads) - before) / seconds
    commlens.agent.stop()
    dist.destroy_process_group()


def idle_cpu_s(seconds: float) -> float:
    """CPU seconds per second that commlens' threads use in a job that issues no collective."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_idle, nprocs=1, start_method="forkserver", args=(free_port(), seconds, out))
        return out["idle_cpu_s"]


def trial(workload: str, config: str, iterations: int, world_size: int = 2, fill: float = 0.0) -> dict:
    """One fresh gloo job of ``workload`` under ``config`` (or the ``YARDSTICK``), its all_reduces' payload
    of ``fill``; rank 0's figures."""
    busy_us = YARDSTICK_US if config == YARDSTICK else 0.0
    settings = None if busy_us or CONFIGS[config] is None else {
        "COMMLENS_METRICS_PORT": str(free_ports(world_size)), "COMMLENS_METRICS_ADDR": "127.0.0.1",
        **CONFIGS[config]}
    with tempfile.TemporaryDirectory(prefix="commlens-agent-cost-") as folder:
        sidecar = None
        if settings is not None:
            settings["COMMLENS_TRACE_FILE"] = os.path.join(folder, "traces-{rank}.jsonl")
        if config == "pod-sidecar":
            settings["COMMLENS_RING_DIR"] = folder
            sidecar = subprocess.Popen([sys.executable, "-m", "commlens.agent.cli", "sidecar", "--ring-dir", folder,
                                        "--metrics-port", "0", "--trace-file", os.path.join(folder, "pod.jsonl")],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert sidecar.stdout.readline().startswith("commlens sidecar:")  # started: from here its CPU counts
            sidecar_started_s = _process_cpu_s(sidecar.pid)
        print(f"trial: {workload}, {config}", file=sys.stderr, flush=True)
        try:
            with mp.Manager() as manager:
                out = manager.dict()
                mp.start_processes(_trial, nprocs=world_size, start_method="forkserver",
                                   args=(world_size, free_port(), workload, iterations, settings, out, busy_us, fill))
                result = dict(out["result"])
            if sidecar is not None:
                result["sidecar_cpu_s"] = _process_cpu_s(sidecar.pid) - sidecar_started_s
        finally:
            if sidecar is not None:
                sidecar.terminate()
                sidecar.wait(30)
        return result


def _spread(values: list[float]) -> str:
    values = sorted(values)
    return f"{values[0]:.3f} - {statistics.median(values):.3f} - {values[-1]:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="every workload and configuration once, briefly")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--cpu-collectives", type=int, default=100_000,
                        help="all_reduces of 4 KiB a one-rank job runs per configuration for the CPU figures")
    parser.add_argument("--cpu-repeats", type=int, default=3, help="one-rank jobs per configuration for the CPU figures")
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds the idle job runs")
    parser.add_argument("--payload", choices=("zeros", "inf"), default="zeros",
                        help="the all_reduces' values: zeros, or Inf in every element (a diverged job, an overflow "
                             "storm: every collective a NaN/Inf event)")
    args = parser.parse_args()
    fill = float("inf") if args.payload == "inf" else 0.0
    # imported once, not per job (DDP imports dynamo, fully_shard FSDP: 2 s and 1 s of CPU)
    mp.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp",
                               "commlens.agent"])
    repeats = 1 if args.quick else args.repeats
    results: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(repeats):
        for workload in args.workloads:
            iterations = 2 if args.quick else WORKLOADS[workload][1]
            for config in CONFIGS:
                results.setdefault((workload, config), []).append(trial(workload, config, iterations, fill=fill))
            print(f"repeat {repeat + 1}/{repeats}: {workload} done", file=sys.stderr, flush=True)
    collectives = 2000 if args.quick else args.cpu_collectives
    cpu: dict[str, list[dict]] = {config: [] for config in [*CONFIGS, YARDSTICK]}
    for _ in range(1 if args.quick else args.cpu_repeats):  # interleaved: each paired with its repeat's "none"
        for config in cpu:
            cpu[config].append(trial("all_reduce 4 KiB", config, collectives, world_size=1, fill=fill))
    print(f"{'workload':<20}{'config':<14}{'ratio min - median - max':>26}")
    for workload in args.workloads:
        baseline = results[(workload, "none")]
        for config in CONFIGS:
            ratios = [run["seconds"] / base["seconds"] for run, base in zip(results[(workload, config)], baseline)]
            print(f"{workload:<20}{config:<14}{_spread(ratios):>26}")
        sums = [run["sum_s"] for run in baseline if run["sum_s"] is not None]
        checks = [run["check_s"] for run in results[(workload, "default")] if run["check_s"] is not None]
        if sums and checks:
            check, one_sum = statistics.median(checks), statistics.median(sums)
            print(f"{workload:<20}NaN check: +{check * 1e6:.1f} µs per collective "
                  f"({min(checks) * 1e6:.1f} - {max(checks) * 1e6:.1f}); one torch.sum over the payload: "
                  f"{one_sum * 1e6:.1f} µs; ratio {check / one_sum:.2f} (goal <= 1.2)")
    print("\nCPU per iteration in the timed trials (2 ranks), by thread of rank 0: its process (every thread) over "
          "the no-commlens trial of the same repeat, in µs and as a ratio; of that, the training thread's share; "
          "commlens' own threads, in µs; medians")
    print(f"{'workload':<20}{'config':<14}{'process over none':>18}{'ratio min - median - max':>26}"
          f"{'training thread':>17}{'commlens threads':>18}")
    for workload in args.workloads:
        baseline = results[(workload, "none")]
        for config in list(CONFIGS)[1:]:
            runs = results[(workload, config)]
            per = [(run["process_cpu_s"] / run["iterations"], base["process_cpu_s"] / base["iterations"])
                   for run, base in zip(runs, baseline)]
            over = statistics.median(on - off for on, off in per) * 1e6
            training = statistics.median((run["training_cpu_s"] - base["training_cpu_s"]) / run["iterations"]
                                         for run, base in zip(runs, baseline)) * 1e6
            threads = statistics.median(run["commlens_cpu_s"] / run["iterations"] for run in runs) * 1e6
            print(f"{workload:<20}{config:<14}{over:>18.1f}{_spread([on / off for on, off in per]):>26}"
                  f"{training:>17.1f}{threads:>18.1f}")
    print(f"\nCPU per collective, µs: one rank, {collectives:,} all_reduces of 4 KiB of {args.payload} per configuration, "
          f"medians of {len(cpu['none'])} interleaved jobs (total: their sum)")
    print(f"{'config':<16}{'commlens threads':>18}{'+training thread':>18}{'pod sidecar':>13}{'total':>8}")
    for config, runs in cpu.items():
        threads = statistics.median(run["commlens_cpu_s"] / run["collectives"] * 1e6 for run in runs)
        extra = statistics.median((run["training_cpu_s"] - base["training_cpu_s"]) / run["collectives"] * 1e6
                                  for run, base in zip(runs, cpu["none"]))
        sidecar = statistics.median(run.get("sidecar_cpu_s", 0.0) / run["collectives"] * 1e6 for run in runs)
        print(f"{config:<16}{threads:>18.1f}{extra:>18.1f}{sidecar:>13.1f}{threads + extra + sidecar:>8.1f}")
    idle_s = 1.0 if args.quick else args.idle_s
    print(f"\nIdle: commlens' threads use {idle_cpu_s(idle_s) * 1e3:.2f} ms of CPU a second in a job that issues no "
          f"collective (defaults, {idle_s:g} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
