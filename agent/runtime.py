"""One call starts commlens in a training process — hooks, sidecar, exporters — and one stops it.

Example::

    import commlens.agent

    commlens.agent.start()      # configured from the environment (agent/config.py); fails here if bad
    ...                         # train: every collective is recorded and exported
    commlens.agent.stop()       # drains the ring, flushes spans, stops serving metrics

Snapshots on the way down: a flight-recorder dump is written (and what is pending flushed, within
``COMMLENS_SNAPSHOT_TIMEOUT_S``) on a collective's abort, on a hang, on SIGTERM and on an unhandled
exception; then the process goes on to end as it would have. SIGTERM's is written even while the
main thread is blocked inside a collective (agent/signals.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from commlens.exporters.otlp import GrpcTransport, HttpTransport, JsonLinesTransport, SpanExporter
from commlens.exporters.prometheus import MetricsCollector, serve
from commlens.hooks import (FlightRecorderHook, cuda, NanCheckHook, attribution, hook_errors, instrument, recorder,
                            register_abort_hook, uninstrument)

from .config import Config, ConfigError
from .job_dumps import JobDumps
from .sidecar import Sidecar
from .signals import SignalWatcher
from .stats import DURATION_BUCKETS

VERSION = "0.1.0"


class Agent:
    def __init__(self, config: Config):
        self.config = config
        self._snapshot_lock = threading.Lock()
        self.transport = _transport(config)
        self.spans = SpanExporter(self.transport, _resource(config), config.job, config.world_size,
                                  config.sampler_ratio, config.sampler.endswith("always_off"), config.span_queue,
                                  interval_s=config.drain_interval_s)
        ring = recorder.ring()
        self.sidecar = Sidecar(ring, config.rank, config.hang_threshold_s, config.slow_factor,
                               on_collective=self.spans.offer, on_hang=lambda _: self.snapshot("hang"))
        self.sidecar.pollers.append(cuda.poll)
        self.server = self.collector = None
        if config.metrics_port is not None:
            self.collector = collector = MetricsCollector(self.sidecar.stats, self.sidecar.inflight_by_group,
                                         lambda: self.sidecar.reader.dropped, lambda: dict(self.spans.counts),
                                         self._info, DURATION_BUCKETS, _telemetry_errors)
            try:
                self.server = serve(collector, config.metrics_addr, config.metrics_port)
            except OSError as error:
                self.spans.shutdown(0.1)
                raise ConfigError(f"COMMLENS_METRICS_PORT: cannot serve metrics on {config.metrics_addr}:"
                                  f"{config.metrics_port} ({error.strerror}); choose a free base port "
                                  "(each rank uses base + LOCAL_RANK), or 0 to serve none") from None
        self.flight_recorder = FlightRecorderHook(max_entries=min(2048, ring.slots // 2)).register_with_comm()
        self.nan_check = None if config.nan_check == "off" else NanCheckHook(config.nan_check).register_with_comm()
        instrument()
        if config.module_attribution:
            attribution.enable()
        self._abort_handle = register_abort_hook(lambda _: self.snapshot("abort"))
        self.job_dumps = JobDumps(config.job, min(1.0, config.hang_threshold_s / 4), lambda: self.snapshot("peer"))
        self.sidecar.start(config.drain_interval_s)
        self._signals = SignalWatcher(lambda: self.snapshot("signal", blocking=False), config.snapshot_timeout_s)
        self._signals.install()  # from the main thread only, as Python's signal handlers
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._on_exception

    def _info(self) -> dict:
        import torch.distributed as dist

        c = self.config
        return {"rank": c.rank, "local_rank": c.local_rank, "world_size": c.world_size, "job": c.job,
                "backend": str(dist.get_backend()) if dist.is_initialized() else "unknown", "version": VERSION}

    def snapshot(self, reason: str, blocking: bool = True) -> str | None:
        """Write a flight-recorder dump and flush pending spans, within the snapshot timeout; returns
        the dump's path (None when another snapshot is being written, or the dump failed). A hang or
        an abort asks every other rank of the job for its dump too; on the way down (an unhandled
        exception, a signal) the metrics wait for Prometheus' next scrape, within the same timeout,
        so that what this rank saw last (a failed collective) is not lost with the process.

        ``blocking=False`` is a signal's (agent/signals.py): the thread it interrupted may hold any
        lock, so it waits on none. The dump needs none and is written even beside another snapshot
        (whole, by rename); the drain before the flush is skipped when another thread is draining, and
        the count is kept without the stats lock when another thread holds it."""
        deadline = time.monotonic() + self.config.snapshot_timeout_s
        if reason in ("hang", "abort"):
            self.job_dumps.request()
        owner = self._snapshot_lock.acquire(blocking=False)
        if not owner and blocking:
            return None
        try:
            try:
                path = self.flight_recorder.dump_file(self.config.rank)
            except (OSError, ValueError) as error:
                print(f"commlens: no {reason} snapshot: {error}", file=sys.stderr)
                path = None
            if owner:
                self.sidecar.drain(blocking)
            stats = self.sidecar.stats
            locked = stats.lock.acquire(blocking)
            stats.snapshots[reason] += 1  # unlocked only on a signal while another thread holds the lock:
            if locked:  # under the GIL that cannot tear a scrape's copy, and one thread counts "signal"
                stats.lock.release()
            self.spans.flush(max(0.0, deadline - time.monotonic()))
            if reason in ("exception", "signal") and self.collector is not None:
                self.collector.wait_for_scrape(max(0.0, deadline - time.monotonic()))
            return path
        finally:
            if owner:
                self._snapshot_lock.release()

    def stop(self) -> None:
        """Stop recording; drain the ring, flush spans (within the snapshot timeout), stop serving."""
        timeout = self.config.snapshot_timeout_s
        self._abort_handle.remove()
        self.job_dumps.stop()
        attribution.disable()
        uninstrument()
        self.sidecar.stop(timeout)
        self.spans.shutdown(timeout)
        self.flight_recorder.unregister()
        if self.nan_check is not None:
            self.nan_check.unregister()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        self._signals.uninstall()
        if sys.excepthook == self._on_exception:
            sys.excepthook = self._previous_excepthook

    def _on_exception(self, kind: type, value: BaseException, traceback: Any) -> None:
        self.snapshot("exception")
        self._previous_excepthook(kind, value, traceback)


def _telemetry_errors() -> dict[str, int]:
    """What commlens lost inside the training process, by ``commlens_telemetry_errors_total``'s kind."""
    return {"hook": sum(hook_errors.values()), "recorder": recorder.internal_errors,
            "string_dropped": recorder.ring().strings_dropped, "work_unjudged": recorder.poller.unjudged,
            "gpu_pool_exhausted": cuda._tracker.exhausted if cuda._tracker is not None else 0}


def _transport(config: Config) -> Any:
    if config.otlp_endpoint is None:
        path = config.trace_file.format(rank=config.rank)
        try:
            return JsonLinesTransport(path)
        except OSError as error:
            raise ConfigError(f"COMMLENS_TRACE_FILE={config.trace_file!r}: cannot write {path!r} "
                              f"({error.strerror}); give a writable path ({{rank}} is replaced)") from None
    if config.otlp_protocol == "grpc":
        return GrpcTransport(config.otlp_endpoint, config.otlp_headers, config.otlp_timeout_s, config.otlp_insecure,
                             config.otlp_certificate)
    return HttpTransport(config.otlp_endpoint, config.otlp_headers, config.otlp_timeout_s, config.otlp_certificate)


def _resource(config: Config) -> dict:
    """``service.name``, ``OTEL_RESOURCE_ATTRIBUTES`` and Kubernetes attributes, by OpenTelemetry's rules."""
    from opentelemetry.sdk.resources import Resource

    own = {"commlens.job": config.job, "commlens.rank": config.rank}
    for variable, key in (("K8S_POD_NAME", "k8s.pod.name"), ("K8S_NAMESPACE_NAME", "k8s.namespace.name"),
                          ("K8S_NODE_NAME", "k8s.node.name")):
        if os.environ.get(variable):
            own[key] = os.environ[variable]
    own.update(config.resource_attributes)
    own["service.name"] = config.service_name or own.get("service.name", "commlens")
    return dict(Resource.create(own).attributes)


_agent: Agent | None = None
_lock = threading.Lock()


def start(config: Config | None = None) -> Agent:
    """Start hooks and sidecar (idempotent); ``config`` defaults to ``Config.from_env()`` with rank
    and world size taken from the default process group when it is initialised (``mp.spawn`` jobs
    that pass ``rank=`` to ``init_process_group``), and the local rank from ``LOCAL_RANK``, else the
    rank (one node)."""
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
