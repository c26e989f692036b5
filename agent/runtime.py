"""One call starts commlens in a training process — hooks, sidecar, exporters — and one stops it.

Example::

    import commlens.agent

    commlens.agent.start()      # configured from the environment (agent/config.py); fails here if bad
    ...                         # train: every collective is recorded and exported
    commlens.agent.stop()       # drains the ring, flushes spans, stops serving metrics

Snapshots on the way down (abort, hang, SIGTERM, an unhandled exception): docs/running.md.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from commlens.hooks import (FlightRecorderHook, cuda, NanCheckHook, attribution, instrument, process_ring, record,
                            register_abort_hook, uninstrument, watch_loss_scaling)
from commlens.hooks._state import state
from commlens.ring.dumps import write_end_note
from commlens.ring.memory import ring_file

from .config import Config, ConfigError
from .job_dumps import JobDumps
from .outputs import MetricsOut
from .pipeline import RankPipeline, dump_entries, writer_info
from .signals import SignalWatcher

VERSION = "0.1.0"
GPU_POLL_S = 0.05
"""How often a rank whose ring a pod sidecar reads polls its GPU collectives' events."""


class Agent:
    """Hooks, and — unless a pod sidecar reads this rank's ring (``COMMLENS_RING_DIR``) — the sidecar
    thread, spans, metrics and snapshots of this process. With a pod sidecar the rank runs only the
    hot path: the ring in the shared folder, the hooks, the NaN check, and snapshot requests written
    into the ring for the pod sidecar to act on (its own, and the job's: ``JobDumps``)."""

    def __init__(self, config: Config):
        self.config = config
        self._snapshot_lock = threading.Lock()
        path = ring_file(config.ring_dir, config.local_rank) if config.ring_dir is not None else config.ring_path
        ring = process_ring.ring_at(path, config.ring_slots)
        self.pipeline: RankPipeline | None = None
        self.sidecar = self.spans = self.metrics_out = self.collector = self.flight_recorder = None
        self._gpu_poller: threading.Thread | None = None
        self._stopping = threading.Event()
        if config.ring_dir is not None:
            import torch

            ring.open()
            ring.describe(writer_info(config, version=VERSION, torch=torch.__version__))
            if torch.cuda.is_available():  # GPU completions are read here, where the events live
                self._gpu_poller = threading.Thread(target=self._poll_gpu, name="commlens-gpu", daemon=True)
                self._gpu_poller.start()
        else:
            self._start_exporting(ring)
        self.job_dumps = JobDumps(config.job, min(1.0, config.hang_threshold_s / 4), lambda: self.snapshot("peer"))
        state.fingerprint_every = config.fingerprint_every
        self.nan_check = None if config.nan_check == "off" else \
            NanCheckHook(config.nan_check, every=config.nan_check_every).register_with_comm()
        # a loss scaler's skipped steps hold Inf by design: the check's findings in them are told apart
        self._unwatch_loss_scaling = watch_loss_scaling() if self.nan_check is not None else None
        instrument()
        if config.module_attribution:
            attribution.enable()
        self._abort_handle = register_abort_hook(lambda _: self.snapshot("abort"))
        if self.sidecar is not None:
            self.sidecar.start(config.drain_interval_s)
        self._signals = SignalWatcher(lambda: self.snapshot("signal", blocking=False), config.snapshot_timeout_s)
        self._signals.install()  # from the main thread only, as Python's signal handlers
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._on_exception

    def _start_exporting(self, ring) -> None:
        config = self.config
        self.pipeline = pipeline = RankPipeline(config, self._info, lambda: self.snapshot("hang"), beside_training=True)
        self.sidecar = pipeline.follow(ring)  # an agent started again goes on from where the last one stopped
        self.sidecar.pollers.append(cuda.poll)
        self.spans, self.collector = pipeline.spans, pipeline.metrics
        try:
            self.metrics_out = MetricsOut(config, self.collector, "a free base port (each rank uses base + LOCAL_RANK)")
        except ConfigError:
            self.spans.shutdown(0.1)
            raise
        self.flight_recorder = FlightRecorderHook(max_entries=dump_entries(ring)).register_with_comm()

    def _poll_gpu(self) -> None:
        while not self._stopping.wait(GPU_POLL_S):
            cuda.poll()

    def _info(self) -> dict:
        import torch.distributed as dist

        return writer_info(self.config, backend=str(dist.get_backend()) if dist.is_initialized() else "unknown",
                           version=VERSION)

    def snapshot(self, reason: str, blocking: bool = True) -> str | None:
        """Write a flight-recorder dump and flush pending spans, within the snapshot timeout; returns
        the dump's path (None when another snapshot is being written, the dump failed, or a pod sidecar
        writes it from a SNAPSHOT record). What each reason adds: docs/running.md ("Snapshots on the
        way down"). ``blocking=False`` is a signal's: the thread it interrupted may hold any lock, so
        it waits on none (``RankPipeline.write_dump``)."""
        if self.pipeline is None:  # a pod sidecar reads this rank's ring: woken to it now
            ring = process_ring.ring()
            record.snapshot(ring.write, reason)
            ring.wake()
            return None
        deadline = time.monotonic() + self.config.snapshot_timeout_s
        if reason in ("hang", "abort"):
            self.job_dumps.request()
        owner = self._snapshot_lock.acquire(blocking=False)
        if not owner and blocking:
            if reason == "exception":  # beside another snapshot (a failed collective's abort): scraped all the same
                self.sidecar.drain()
                self.collector.wait_for_scrape(max(0.0, deadline - time.monotonic()))
            return None
        try:
            path = self.pipeline.write_dump(reason, self.flight_recorder.dump, drain=owner, blocking=blocking)
            self.spans.flush(max(0.0, deadline - time.monotonic()))
            if reason in ("exception", "signal"):
                self.collector.wait_for_scrape(max(0.0, deadline - time.monotonic()))
            return path
        finally:
            if owner:
                self._snapshot_lock.release()

    def stop(self) -> None:
        """Stop recording and flush, within the snapshot timeout whatever the collector does; with a pod
        sidecar, mark the ring closed (the rank ended cleanly)."""
        deadline = time.monotonic() + self.config.snapshot_timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())
        self._abort_handle.remove()
        attribution.disable()
        state.fingerprint_every = 0
        uninstrument()
        if self.nan_check is not None:
            self.nan_check.unregister()
            self._unwatch_loss_scaling()
        self._signals.uninstall()
        if sys.excepthook == self._on_exception:
            sys.excepthook = self._previous_excepthook
        self._stopping.set()
        if self._gpu_poller is not None:
            self._gpu_poller.join(left())
            cuda.poll()
        self.job_dumps.stop()
        if self.pipeline is None:  # a pod sidecar reads this rank's ring
            process_ring.ring().close()
        else:
            self.pipeline.stop(left())
            self.flight_recorder.unregister()
            self.collector.ended = True  # an endpoint gone without it: the rank was killed (docs/verdicts.md)
            self.metrics_out.stop(deadline)
        try:  # a rank killed leaves none: the verdict tells it from one that ended (docs/verdicts.md)
            write_end_note(self.config.rank, self.config.attempt)
        except OSError as error:
            print(f"commlens: no note that rank {self.config.rank} ended: {error}", file=sys.stderr)

    def _on_exception(self, kind: type, value: BaseException, traceback: Any) -> None:
        self.snapshot("exception")
        self._previous_excepthook(kind, value, traceback)


_agent: Agent | None = None
_lock = threading.Lock()


def start(config: Config | None = None) -> Agent:
    """Start hooks and sidecar (idempotent); ``config`` defaults to ``Config.from_env()`` with the
    ranks of the initialised default process group (``ranks_from_group``)."""
    global _agent
    with _lock:
        if _agent is None:
            _agent = Agent(config or Config.from_env({**os.environ, **ranks_from_group()}))
        return _agent


def ranks_from_group() -> dict[str, str]:
    """``RANK``, ``WORLD_SIZE`` (and ``LOCAL_RANK`` when unset) of the initialised default group; {} without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {}
    rank = str(dist.get_rank())
    return {"RANK": rank, "WORLD_SIZE": str(dist.get_world_size()), "LOCAL_RANK": os.environ.get("LOCAL_RANK", rank)}


def stop() -> None:
    """Stop what ``start()`` started, flushing; safe to call twice."""
    global _agent
    with _lock:
        if _agent is not None:
            _agent.stop()
            _agent = None


def current() -> Agent | None:
    return _agent
