"""The demo job: a small DDP model trained by N gloo processes on CPU under commlens.

What each rank runs, what the launcher prints, the files it writes and the faults it can inject
(``--inject nan:rank=2:step=3``, ...): docs/demo.md.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime
import json
import multiprocessing.forkserver
import multiprocessing.synchronize
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .ports import free_port, free_ports, reserve

FAULTS = ("nan", "slow", "hang", "desync", "size", "skip")
DEMO_HANG_THRESHOLD_S = "2"


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int = 0
    ms: int = 0
    s: int = 0
    """hang only: seconds to stall (0: the hang threshold + 2 s)."""

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``kind:rank=R:step=S`` (``slow:rank=R:ms=M``, ``hang:...:s=N``), e.g. ``nan:rank=1:step=3``."""
        usage = (f"--inject {text!r} is not accepted: use KIND:rank=R:step=S with KIND one of "
                 f"{', '.join(k for k in FAULTS if k != 'slow')}, hang:rank=R:step=S:s=SECONDS, "
                 "or slow:rank=R:ms=M")
        kind, _, rest = text.partition(":")
        fields = dict(part.partition("=")[::2] for part in rest.split(":") if part)
        accepted = [{"rank", "ms"}] if kind == "slow" else [{"rank", "step"}]
        if kind == "hang":
            accepted.append({"rank", "step", "s"})
        if kind not in FAULTS or set(fields) not in accepted:
            raise ValueError(usage)
        try:
            values = {key: int(value) for key, value in fields.items()}
        except ValueError:
            raise ValueError(usage) from None
        if min(values.values()) < 0:
            raise ValueError(usage)
        return cls(kind, **values)


def _hit(faults: tuple[Fault, ...], kind: str, rank: int, step: int) -> Fault | None:
    return next((fault for fault in faults
                 if (fault.kind, fault.rank) == (kind, rank) and (kind == "slow" or fault.step == step)), None)


def demo_job_id() -> str:
    """The demo's job id: ``COMMLENS_JOB_ID``, else a new one."""
    return os.environ.get("COMMLENS_JOB_ID") or f"demo-{os.getpid()}-{int(time.time())}"


def demo_environment(out_dir: str, world_size: int, job: str) -> dict[str, str]:
    """The demo's defaults (metrics on free ports) for job ``job``; what the user's environment sets wins."""
    defaults = {"COMMLENS_METRICS_ADDR": "127.0.0.1", "COMMLENS_HANG_THRESHOLD_S": DEMO_HANG_THRESHOLD_S,
                "COMMLENS_METRICS_PORT": str(free_ports(world_size)),
                "COMMLENS_TRACE_FILE": os.path.join(out_dir, "traces-rank{rank}.jsonl"),
                "COMMLENS_JOB_ID": job,
                "COMMLENS_METRICS_DETAIL": "full",  # a few ranks: every op and size class on the dashboards
                "TORCHCOMM_FR_DUMP_TEMP_FILE": os.path.join(out_dir, "rank_")}
    return {**defaults, **{k: v for k, v in os.environ.items() if k in defaults}}


def _train(rank: int, world_size: int, steps: int, out_dir: str, port: int, faults: tuple[Fault, ...],
           serving: multiprocessing.synchronize.Event | None, environment: dict[str, str], launcher: int) -> None:
    """One rank, forked from a server that imported torch once (not once per rank), with the
    launcher's whole environment (``environment``), not the server's."""
    import commlens.agent

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a spawned rank's, not the server's
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    threshold = float(os.environ["COMMLENS_HANG_THRESHOLD_S"])
    timeout = datetime.timedelta(seconds=threshold + 10 if {f.kind for f in faults} & {"desync", "size", "skip"}
                                 else max([300] + [f.s + 60 for f in faults]))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    agent = commlens.agent.start()  # with the NaN/Inf check, on by default
    _wait_for_all("started", rank, world_size, timeout)
    pg = dist.distributed_c10d._get_default_group()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    step_seqs = []
    try:
        for step in range(steps):
            step_seqs.append(pg._get_sequence_number_for_group())
            if _hit(faults, "skip", rank, step):
                break  # the injected fault: this rank stops issuing collectives
            if hang := _hit(faults, "hang", rank, step):
                time.sleep(hang.s or threshold + 2)  # the injected fault: this rank is late past the threshold
            if slow := _hit(faults, "slow", rank, step):
                time.sleep(slow.ms / 1000)
            lr = torch.tensor([0.05, 0.0] if _hit(faults, "size", rank, step) else [0.05])
            dist.broadcast(lr, src=0)
            optimizer.param_groups[0]["lr"] = float(lr[0])
            x = torch.randn(64, 32, generator=generator)
            if _hit(faults, "nan", rank, step):
                x[0, 0] = float("nan")
            loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if _hit(faults, "desync", rank, step):
                dist.broadcast(loss.detach(), src=0)
            else:
                dist.all_reduce(loss.detach())
            if rank == 0:
                _progress(step + 1, steps)
        else:
            dist.barrier()
    except RuntimeError as error:  # an injected fault timed out; the abort hook already took a snapshot
        print(f"rank {rank}: {str(error).splitlines()[0]}", file=sys.stderr)
    step_seqs.append(pg._get_sequence_number_for_group())
    agent.sidecar.stop()
    agent.flight_recorder.dump_file(rank)
    _write_result(out_dir, rank, agent, step_seqs, model)
    _wait_for_all("done", rank, world_size, timeout)
    if serving is not None:  # --keep-serving: until the launcher, on SIGTERM or Ctrl-C, sets the event
        # A terminal's Ctrl-C, or a SIGTERM to the process group, reaches every rank: the launcher decides.
        # (A rank ended by it inside the event's wait left the event's lock held, and the launcher's
        # handler waited on it for ever.)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        sys.stdout.write(f"rank {rank}: serving metrics until SIGTERM or Ctrl-C\n")  # one write: lines stay whole
        sys.stdout.flush()
        while not serving.wait(1) and _alive(launcher):
            pass  # a launcher killed outright (SIGKILL) ends the serving too
    commlens.agent.stop()
    dist.destroy_process_group()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _progress(done: int, total: int) -> None:
    filled = 30 * done // total
    print(f"\r  [{'#' * filled}{'.' * (30 - filled)}] step {done}/{total}", end="\n" if done == total else "",
          file=sys.stderr, flush=True)


def _write_result(out_dir: str, rank: int, agent, step_seqs: list[int], model) -> None:
    stats = agent.sidecar.stats.snapshot()
    ops: dict[str, dict] = {}
    for (op, pg, _), (counts, _, seconds) in stats.durations.items():
        mine = ops.setdefault(op, {"buckets": [0] * len(counts), "seconds": 0.0, "bus_bytes": 0.0})
        mine["buckets"] = [a + b for a, b in zip(mine["buckets"], counts)]
        mine["seconds"] += seconds
    for (op, pg), bus_bytes in stats.bus_bytes.items():
        if op in ops:
            ops[op]["bus_bytes"] += bus_bytes
    result = {
        "rank": rank, "step_seqs": step_seqs, "ops": ops,
        "collective_seconds": sum(seconds for _, _, seconds in stats.durations.values()),
        "completed": sum(stats.completed.values()),
        "nan_events": sum(stats.nans.values()), "hangs": sum(stats.hangs.values()),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    with open(os.path.join(out_dir, f"result-rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _wait_for_all(point: str, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """Wait, through the job's store (no collective, nothing recorded), until every rank has come to
    ``point``: "started", so that the ranks' start-up (imports, the agent) on a busy machine is not
    taken for a late rank in the first collective; "done", to keep every rank's connections open until
    all have written their results, so that a stopped rank is seen as missing from a collective (a
    timeout) rather than as a closed connection."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"commlens/{point}/{rank}", "1")
    with contextlib.suppress(RuntimeError):  # a rank died first: nothing more to wait for
        store.wait([f"commlens/{point}/{r}" for r in range(world_size)], timeout * 3)


@dataclasses.dataclass
class Outcome:
    summary: str
    results: list[dict]
    analyzer: subprocess.CompletedProcess


def run(world_size: int, steps: int, out_dir: str, faults: tuple[Fault, ...] = (),
        keep_serving: bool = False, environment: dict[str, str] | None = None) -> Outcome:
    """Train with ``world_size`` ranks (in ``environment``, default ``demo_environment``); returns the
    summary, each rank's result and torchfrtrace's run."""
    os.makedirs(out_dir, exist_ok=True)
    environment = environment or demo_environment(out_dir, world_size, demo_job_id())
    from ..config import Config
    from commlens.hooks import distributed

    config = Config.from_env({**os.environ, **environment})  # a bad setting fails here, before any rank starts
    metrics = config.metrics_port or 0
    reserve(range(metrics, metrics + world_size))  # the store's port is not one the ranks serve on
    store = int(os.environ.get("MASTER_PORT") or 0) or free_port()  # torchrun's variable, where it is set
    distributed.build_extensions()
    forkserver = mp.get_context("forkserver")
    # imported once, not once per rank (DDP's constructor imports dynamo: 2 s of CPU)
    forkserver.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "commlens.agent"])
    ignored = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:  # the server ignores SIGTERM (a SIGTERM to the process group is for the launcher and the ranks)
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, ignored)
    serving = forkserver.Event() if keep_serving else None
    ranks = mp.start_processes(_train, args=(world_size, steps, out_dir, store, faults, serving,
                                             {**os.environ, **environment}, os.getpid()),
                               nprocs=world_size, start_method="forkserver", join=False)
    previous = {signum: signal.signal(signum, lambda *_: serving.set()) for signum in (signal.SIGTERM, signal.SIGINT)
                if serving is not None}
    try:  # with --keep-serving, SIGTERM or Ctrl-C ends the serving; every rank stops cleanly, then the summary
        while not ranks.join():
            pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    results = []
    for rank in range(world_size):
        with open(os.path.join(out_dir, f"result-rank{rank}.json")) as f:
            results.append(json.load(f))
    analyzer = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", out_dir],
                              capture_output=True, text=True)
    return Outcome(summarize(results, out_dir, faults), results, analyzer)


def summarize(results: list[dict], out_dir: str, faults: tuple[Fault, ...] = ()) -> str:
    """The closing summary: per op, then per rank, then the verdict that ``commlens diagnose`` gives
    on the job's trace files and dumps, with the training step of each finding; the injected faults
    are listed apart, labelled as such — no verdict line is derived from them."""
    from ..verdicts import findings
    from ..verdicts.timeline import durations_ms, quantile, read_facts

    found, facts = read_facts(out_dir)  # the report's read: its percentiles, its verdict
    durations = durations_ms(found, lambda s: (s.op,))
    lines = [f"{'op':<16}{'count':>8}{'p50 ms':>10}{'p99 ms':>10}{'busbw MB/s':>12}"]
    ops: dict[str, dict] = {}
    for result in results:
        for op, mine in result["ops"].items():
            seen = ops.setdefault(op, {"buckets": [0] * len(mine["buckets"]), "seconds": 0.0, "bus_bytes": 0.0})
            seen["buckets"] = [a + b for a, b in zip(seen["buckets"], mine["buckets"])]
            seen["seconds"] += mine["seconds"]
            seen["bus_bytes"] += mine["bus_bytes"]
    for op, seen in sorted(ops.items()):
        busbw = seen["bus_bytes"] / seen["seconds"] / 1e6 if seen["seconds"] > 0 else 0.0
        spans = durations.get((op,))
        p50, p99 = (f"{quantile(spans, q):>10.3f}" for q in (0.5, 0.99)) if spans else (f"{'-':>10}",) * 2
        lines.append(f"{op:<16}{sum(seen['buckets']):>8}{p50}{p99}{busbw:>12.1f}")
    lines.append(f"{'rank':<6}{'nan events':>12}{'hangs':>8}{'in collectives s':>18}")
    lines += [f"{result['rank']:<6}{result['nan_events']:>12}{result['hangs']:>8}{result['collective_seconds']:>18.3f}"
              for result in results]
    verdict = findings(facts)
    for finding in verdict:
        step = f" (step {_step(results[0], finding.seq)})" if finding.seq is not None and results else ""
        lines.append(f"verdict{step}: {finding.line()}")
    if not verdict:
        lines.append("verdict: nothing wrong found")
    for fault in faults:
        where = f"ms={fault.ms}" if fault.kind == "slow" else f"step {fault.step}"
        lines.append(f"injected (not used by the verdict): {fault.kind} on rank {fault.rank}, {where}")
    return "\n".join(lines)


def _step(result: dict, seq: int) -> int:
    """The training step whose collectives include ``seq``."""
    return max(0, bisect.bisect_left(result["step_seqs"], seq) - 1)
