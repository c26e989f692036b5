"""``commlens run [options] -- COMMAND…``: run a command with commlens in every distributed rank it starts.

It puts a ``sitecustomize`` module (``agent/autostart/``) first on ``PYTHONPATH``; Python imports it
at start-up in every process of the command's tree. In a process that is a distributed rank (``RANK``
is set, as torchrun and the other launchers set it) it starts ``commlens.agent`` and stops it, flushing,
at exit; every other process (torchrun's own agent, data-loader workers started with ``RANK`` unset,
tools) is left alone. A ``sitecustomize`` the job had is still imported after ours.

With ``--sidecar`` the ranks run only the hot path and one ``commlens sidecar`` process (started
first, stopped after the command, as Kubernetes runs a native sidecar container) exports for them
all from their rings in ``COMMLENS_RING_DIR`` (a new temporary folder unless one is given).

Example::

    commlens run --hang-threshold 120 -- torchrun --nproc-per-node 4 train.py
    commlens run --sidecar -- torchrun --nproc-per-node 4 train.py
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from commlens.hooks import extension
from .config import Config, ConfigError
from .ports import refuse_taken

AUTOSTART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "autostart")
MARKER = "COMMLENS_AUTOSTART"


def environment(base: dict[str, str], settings: dict[str, str]) -> dict[str, str]:
    """``base`` with the options applied, the marker set and our ``sitecustomize`` first on the path."""
    env = {**base, **settings, MARKER: "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [AUTOSTART, base.get("PYTHONPATH")]))
    return env


def run(command: list[str], settings: dict[str, str], sidecar: bool = False) -> int:
    """Check the configuration as a rank would see it, then run ``command`` (beside a pod sidecar
    process when ``sidecar``); returns its exit status."""
    env = environment(dict(os.environ), settings)
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
        if config.otlp_endpoint is None and not env.get("COMMLENS_TRACE_FILE"):
            print(f"commlens run: spans go to {os.path.abspath(config.trace_file)} (set COMMLENS_TRACE_FILE, or "
                  "OTEL_EXPORTER_OTLP_ENDPOINT for a collector)", file=sys.stderr, flush=True)
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
                pod.send_signal(signal.SIGTERM)
                try:
                    pod.wait(config.snapshot_timeout_s + 10)
                except subprocess.TimeoutExpired:
                    pod.kill()
                    pod.wait()
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def local_ranks(command: list[str]) -> int:
    """How many ranks ``command`` starts on this node, as far as its arguments say: torchrun's
    ``--nproc-per-node N`` (or ``--nproc_per_node``), else 1.

    >>> local_ranks(["torchrun", "--nproc-per-node=4", "train.py"])
    4
    """
    for i, arg in enumerate(command):
        name, _, value = arg.partition("=")
        if name in ("--nproc-per-node", "--nproc_per_node"):
            value = value or (command[i + 1] if i + 1 < len(command) else "")
            return int(value) if value.isdigit() else 1
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
    from .pod import PodSidecar

    config = Config.from_env({**os.environ, **settings, "RANK": "0", "LOCAL_RANK": "0"})
    if config.ring_dir is None:
        raise ConfigError("COMMLENS_RING_DIR is not set: give the folder the ranks write their rings in "
                          "(--ring-dir, or the variable), the same in the training container and here")
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    pod = PodSidecar(config, config.ring_dir)
    pod.start()
    where = f"{config.metrics_addr}:{config.metrics_port}" if config.metrics_port is not None else "not served"
    print(f"commlens sidecar: reading the rings in {config.ring_dir}; metrics {where}", flush=True)
    stopping.wait()
    pod.stop()
    return 0
