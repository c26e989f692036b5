"""``commlens run [options] -- COMMAND…``: run a command with commlens in every distributed rank it starts.

How it starts commlens in the ranks (a ``sitecustomize`` first on ``PYTHONPATH``), the sidecar it
starts and the job's folder: docs/running.md.

Example::

    commlens run --hang-threshold 120 -- torchrun --nproc-per-node 4 train.py
    commlens run --in-process -- torchrun --nproc-per-node 4 train.py
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from commlens.hooks import extension
from ..config import Config, ConfigError
from .ports import refuse_taken
from ..verdicts.readers import NO_TELEMETRY, NOT_STARTED, attempts_in, kept_and_said

OUT_ROOT = "commlens-out"
"""Where each job's folder goes, under the current folder, unless ``--out`` says."""
AUTOSTART = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "autostart")
MARKER = "COMMLENS_AUTOSTART"


def environment(base: dict[str, str], settings: dict[str, str]) -> dict[str, str]:
    """``base`` with the options applied, the marker set and our ``sitecustomize`` first on the path."""
    return {**base, **settings, MARKER: "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [AUTOSTART, base.get("PYTHONPATH")]))}


def job_folder(env: dict[str, str], out: str | None) -> str | None:
    """Give the job an id in ``env`` (``COMMLENS_JOB_ID``, else a new one) and one folder for the trace
    files and dumps ``env`` does not put elsewhere: ``out``, else ``./commlens-out/<job id>``. Returns
    the folder, made here (``make_job_folder``), or None when nothing goes there."""
    job = env.setdefault("COMMLENS_JOB_ID", time.strftime("%Y%m%d-%H%M%S-") + str(os.getpid()))
    folder = os.path.relpath(out or os.path.join(OUT_ROOT, job))
    defaults = {"TORCHCOMM_FR_DUMP_TEMP_FILE": os.path.join(folder, "rank_")}
    if not env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        defaults["COMMLENS_TRACE_FILE"] = os.path.join(folder, "traces-{rank}.jsonl")
    unset = {name: value for name, value in defaults.items() if not env.get(name)}
    if not unset:
        return None
    make_job_folder(folder)
    env.update(unset)
    return folder


def make_job_folder(folder: str) -> None:
    """Make ``folder`` for one job's files; ``ConfigError`` for one that cannot be made or that holds
    files already (another job's: never written over)."""
    if os.path.isdir(folder) and os.listdir(folder):
        raise ConfigError(f"the job's folder {folder} holds files already (another job's, kept): give another "
                          "--out, or another --job-id")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot make the job's folder {folder} ({error.strerror}): give --out a folder "
                          "this user can write") from None


def conclude(folder: str) -> tuple[list[str], list[str]]:
    """Write the verdict (``verdict.txt``, as ``commlens diagnose`` prints it), the report
    (``report.html``) and the timeline (``timeline.json``) of the job in ``folder``, and of each attempt
    of it that torchrun restarted in its own (``attempt-N``, the lines then prefixed "attempt N: ");
    returns the verdict's lines and the paths written (none where a folder holds no telemetry). What
    cannot be read is named on stderr and in the verdict."""
    attempts = attempts_in(folder)
    said, written = [], []
    for attempt, where in attempts:
        lines, paths = _conclude_one(where)
        said += [f"attempt {attempt}: {line}" for line in lines] if len(attempts) > 1 else lines
        written += paths
    return said, written


def _conclude_one(folder: str) -> tuple[list[str], list[str]]:
    from ..verdicts import diagnose, findings, report, timeline

    unread: list[str] = []
    found, facts = timeline.read_facts(folder, kept_and_said(unread))
    if not facts:
        return [f"no telemetry in {folder}: {NO_TELEMETRY}"], []
    lines = diagnose.report(facts, unread)
    written = [os.path.join(folder, "verdict.txt"), os.path.join(folder, "report.html")]
    with open(written[0], "w", encoding="utf-8", errors="backslashreplace") as f:
        f.write("".join(line + "\n" for line in lines))
    with open(written[1], "w", encoding="utf-8", errors="backslashreplace") as f:
        f.write(report.page(folder, found, facts, unread))
    if found:
        written.append(timeline.write(folder, read=(found, findings(facts))))
    return lines, written


def run(command: list[str], settings: dict[str, str], sidecar: bool | None = None, out: str | None = None) -> int:
    """Check the configuration as a rank would see it, then run ``command`` beside a pod sidecar process
    (``sidecar``; None: unless a ring folder is given, whose sidecar runs beside), its files in one
    folder (``job_folder``); returns its exit status."""
    env = environment(dict(os.environ), settings)
    if sidecar is None:
        sidecar = not env.get("COMMLENS_RING_DIR")
    made = None
    if sidecar and not env.get("COMMLENS_RING_DIR"):
        made = env["COMMLENS_RING_DIR"] = tempfile.mkdtemp(prefix="commlens-rings-")
    try:
        config = Config.from_env({**env, "RANK": env.get("RANK", "0")})  # a bad setting fails here, not in every rank
        if sidecar:  # one port for the pod
            refuse_taken(config.metrics_addr, config.metrics_port or 0, 1, None,
                         "choose another port for the pod sidecar, or 0 to serve none")
        else:
            refuse_taken(config.metrics_addr, config.metrics_port or 0, local_ranks(command), "local rank",
                         "choose another base port (each local rank serves on base + LOCAL_RANK), or 0 to serve none")
        if env.get("COMMLENS_TRACE_FILE"):  # the user's own (the job's folder, made below, is writable)
            refuse_unwritable(config)
        folder = job_folder(env, out)
        if folder is not None:
            env["COMMLENS_NOT_STARTED"] = os.path.abspath(os.path.join(folder, NOT_STARTED))
            print(f"commlens run: job {env['COMMLENS_JOB_ID']}: its trace files and flight-recorder dumps go to "
                  f"{folder}", file=sys.stderr, flush=True)
        if not extension.ready():  # torch (seconds of CPU) imported by the launcher only to build them
            from commlens.hooks import distributed

            distributed.build_extensions()
        pod = None
        if sidecar:
            pod_env = {key: value for key, value in env.items() if key != MARKER}
            pod = subprocess.Popen([sys.executable, "-m", "commlens.agent.cli", "sidecar"], env=pod_env)
        try:
            return _call_forwarding_signals(command, env)
        except FileNotFoundError:
            print(f"commlens run: {command[0]!r} was not found", file=sys.stderr)
            return 127
        finally:
            if pod is not None:
                if (ended := pod.poll()) is not None:
                    print(f"commlens run: the pod sidecar ended during the job (exit status {ended}): what the "
                          "ranks did after that was not exported", file=sys.stderr)
                pod.send_signal(signal.SIGTERM)
                try:
                    pod.wait(3 * config.snapshot_timeout_s + 10)  # its ranks' ends, its last pass, its flush (PodSidecar.stop)
                except subprocess.TimeoutExpired:
                    pod.kill()
                    pod.wait()
            if folder is not None:
                try:
                    lines, written = conclude(folder)
                except Exception as error:  # noqa: BLE001 — the command's own status is what run returns
                    lines, written = [f"none written: {error!r}"], []
                for line in lines:
                    print(f"commlens run: verdict: {line}", file=sys.stderr)
                print(f"commlens run: the job's files are in {folder}" + (
                    f" (wrote {', '.join(os.path.relpath(path, folder) for path in written)})" if written else ""),
                    file=sys.stderr)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def refuse_unwritable(config: Config) -> None:
    """``ConfigError`` for a trace file (``COMMLENS_TRACE_FILE``) that the ranks could not write, before
    any starts: a rank that cannot start commlens trains unobserved."""
    if config.otlp_endpoint is not None:
        return
    try:
        where = os.path.dirname(os.path.abspath(config.trace_file.format(rank=0)))
    except (KeyError, IndexError, ValueError) as error:
        raise ConfigError(f"COMMLENS_TRACE_FILE={config.trace_file!r} is not accepted ({error!r}): give a path in "
                          "which {rank} is the only field") from None
    if not (os.path.isdir(where) and os.access(where, os.W_OK)):
        raise ConfigError(f"COMMLENS_TRACE_FILE={config.trace_file!r}: cannot write in {where!r} (no such folder, "
                          "or not this user's to write); give a writable path ({rank} is replaced)")


def local_ranks(command: list[str]) -> int:
    """How many ranks ``command`` starts on this node, as far as its arguments say: torchrun's
    ``--nproc-per-node`` (or ``--nproc_per_node``: a number, or ``gpu``, ``cpu``, ``auto``... as
    torchrun counts them), else 1.

    >>> local_ranks(["torchrun", "--nproc-per-node=4", "train.py"])
    4
    """
    for i, arg in enumerate(command):
        name, _, value = arg.partition("=")
        if name in ("--nproc-per-node", "--nproc_per_node"):
            value = value or (command[i + 1] if i + 1 < len(command) else "")
            if value.isdigit():
                return int(value)
            from torch.distributed.run import determine_local_world_size  # torch (seconds) for a word only

            try:
                return determine_local_world_size(value)
            except Exception:  # noqa: BLE001 — torchrun refuses it itself, with its own message
                return 1
    return 1


def _call_forwarding_signals(command: list[str], env: dict[str, str]) -> int:
    """Run ``command`` and wait for it, as a shell runs a foreground command: a SIGTERM sent to us goes
    on to it (Kubernetes signals only a container's first process), and Ctrl-C's SIGINT, which the
    terminal sends it too, leaves the ending to it. Returns its exit status, 128 + N if signal N ended it."""
    child = subprocess.Popen(command, env=env)
    handlers = {signal.SIGTERM: lambda signum, _: child.send_signal(signum), signal.SIGINT: lambda *_: None}
    previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        status = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return status if status >= 0 else 128 - status


def serve_pod(settings: dict[str, str]) -> int:
    """``commlens sidecar``: serve the rings in ``COMMLENS_RING_DIR`` until SIGTERM or SIGINT."""
    from ..pod import PodSidecar

    config = Config.from_env({**os.environ, **settings, "RANK": "0", "LOCAL_RANK": "0"})
    if config.ring_dir is None:
        raise ConfigError("COMMLENS_RING_DIR is not set: give the folder the ranks write their rings in "
                          "(--ring-dir, or the variable), the same in the training container and here")
    pod = PodSidecar(config, config.ring_dir)
    stopping = threading.Event()

    def on_signal(*_) -> None:
        if stopping.is_set():  # told twice: no more waiting for the ranks to end
            pod.stop_waiting()
        stopping.set()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    pod.start()
    where = f"{config.metrics_addr}:{config.metrics_port}" if config.metrics_port is not None else "not served"
    print(f"commlens sidecar: reading the rings in {config.ring_dir}; metrics {where}", flush=True)
    stopping.wait()
    print(f"commlens sidecar: stopping once every rank's process has ended (at most {config.snapshot_timeout_s:g} s), "
          "their last snapshots written; told again, at once", flush=True)
    pod.stop()
    return 0
