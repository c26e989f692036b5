"""One rank's telemetry from its ring to the exporters: drain → stats → spans and metrics, wired once.

The in-process agent runs one for its rank; the pod sidecar one per local rank, which ``follow``s
the rank from ring to ring as it restarts. It is the ``RankTelemetry`` its metrics collector reads.
Imports no torch.

Example::

    pipeline = RankPipeline(config, info, on_hang=lambda: print("hang"))
    pipeline.follow(ring).start(config.drain_interval_s)   # the sidecar thread
    serve(pipeline.metrics, "0.0.0.0", 9464)
    ...
    pipeline.stop(timeout_s=5)                            # drains what is left, flushes spans
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any, Callable, Mapping

from commlens.exporters.otlp import BatchSpanProcessor
from commlens.exporters.prometheus import MetricsCollector
from commlens.exporters.telemetry import Collective, GroupInFlight, StatsSnapshot
from commlens.ring.dumps import write_dump
from commlens.ring.layout import ERRORS
from commlens.ring.memory import Ring

from .config import Config
from .outputs import span_processor
from .sidecar import Sidecar
from .stats import DURATION_BUCKETS, Stats, exposed_buckets


class RankPipeline:
    """``info()`` gives ``commlens_info``'s labels; ``on_hang()`` runs once per drain that finds a
    hang, ``on_snapshot(reason)`` for a writer's SNAPSHOT record. ``beside_training``: it runs in the
    training process (the sidecar hands the GIL over while it builds spans)."""

    def __init__(self, config: Config, info: Callable[[], Mapping[str, Any]], on_hang: Callable[[], None],
                 on_snapshot: Callable[[str], None] = lambda reason: None, beside_training: bool = False):
        self.config, self._info, self.beside_training = config, info, beside_training
        self.on_hang, self.on_snapshot = on_hang, on_snapshot
        self.stats = Stats()
        self.spans: BatchSpanProcessor = span_processor(config, beside_training)
        self.sidecar: Sidecar | None = None
        self._dropped_before = 0
        self._errors_before = dict.fromkeys(ERRORS, 0)
        self.metrics = MetricsCollector(self, DURATION_BUCKETS, exposed_buckets(config.metrics_detail))
        self.signalled_ns: int | None = None
        """When the rank was signalled to stop, in its dumps from then on (``dumps.DUMP_SIGNALLED``)."""
        self.reasons: tuple[str, ...] = ()
        """Why the rank's dumps were written so far (``dumps.DUMP_REASONS``)."""

    def follow(self, ring: Ring) -> Sidecar:
        """Drain ``ring`` from now on, from its stored cursor (the rank's first ring, or a restarted
        rank's new one: what the last one lost stays counted); returns its sidecar."""
        if self.sidecar is not None:
            self.sidecar.drain()
            self.sidecar.writer_ended()
            self._dropped_before += self.sidecar.reader.dropped
            self._errors_before = dict(self.telemetry_errors())
        c = self.config
        self.sidecar = Sidecar(ring, c.rank, c.hang_threshold_s, c.slow_factor, on_collective=self.spans.queue,
                               sample=self.spans.sampled, on_hang=self._hung,
                               on_snapshot=self.on_snapshot, stats=self.stats, resume=True, detail=c.metrics_detail,
                               beside_training=self.beside_training)
        return self.sidecar

    def _hung(self, collective: Collective) -> None:
        """A collective newly past the hang threshold: said on the console at once, one line (the job's
        terminal: ``commlens run``'s ranks and pod sidecar write to it), then ``on_hang()``."""
        where = f"group {collective.pg}" + ("" if collective.is_p2p else f", seq {collective.seq}")
        print(f"commlens: rank {collective.rank} has waited over {self.config.hang_threshold_s:g} s in {collective.op} "
              f"({where}), past the hang threshold; `commlens diagnose` names whom it waits for", file=sys.stderr,
              flush=True)
        self.on_hang()

    def write_dump(self, reason: str, dump: Callable[[], dict], drain: bool = False, blocking: bool = True) -> str | None:
        """Write the rank's flight-recorder dump ``dump()`` for ``reason``, then (``drain``) drain the
        ring, and count it; the dump's path, or None when it failed. ``blocking=False`` (a signal's:
        the interrupted thread may hold any lock): the drain is skipped when another thread is
        draining, and the count is kept without the stats lock when another thread holds it."""
        if reason == "signal" and self.signalled_ns is None:
            self.signalled_ns = time.time_ns()
        self.reasons += (reason,)
        try:
            path = write_dump(dump(), self.config.rank, self.signalled_ns, self.reasons, self.config.attempt)
        except (OSError, ValueError) as error:
            print(f"commlens: no {reason} snapshot: {error}" if self.beside_training else
                  f"commlens sidecar: no {reason} snapshot of rank {self.config.rank}: {error}", file=sys.stderr)
            path = None
        if drain:
            self.sidecar.drain(blocking)
        stats = self.stats
        locked = stats.lock.acquire(blocking)
        stats.snapshots[reason] += 1  # unlocked only on a signal while another thread holds the lock:
        if locked:  # under the GIL that cannot tear a scrape's copy, and one thread counts "signal"
            stats.lock.release()
        return path

    def stop(self, timeout_s: float) -> None:
        """Stop the sidecar's thread, drain what is left, and send the spans queued: all within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        if self.sidecar is not None:
            self.sidecar.stop(timeout_s)
        self.spans.shutdown(max(0.0, deadline - time.monotonic()))

    # -- RankTelemetry: what a scrape reads ---------------------------------------------------------

    def stats_snapshot(self) -> StatsSnapshot:
        return self.stats.snapshot()

    def inflight_by_group(self) -> Mapping[str, GroupInFlight]:
        return self.sidecar.inflight_by_group() if self.sidecar is not None else {}

    def dropped(self) -> int:
        return self._dropped_before + (self.sidecar.reader.dropped if self.sidecar is not None else 0)

    def span_results(self) -> Mapping[str, int]:
        return dict(self.spans.counts)

    def telemetry_errors(self) -> Mapping[str, int]:
        now = self.sidecar.ring.errors() if self.sidecar is not None else {}
        return {kind: self._errors_before[kind] + now.get(kind, 0) for kind in ERRORS}

    def info(self) -> Mapping[str, Any]:
        return self._info()


def writer_info(config: Config, **more: Any) -> dict:
    """Who the rank is (rank, local rank, world size, job, node) and ``more``: ``commlens_info``'s labels,
    and what a ring's ``describe`` records."""
    return {"rank": config.rank, "local_rank": config.local_rank, "world_size": config.world_size, "job": config.job,
            "attempt": config.attempt, "node": node_name(config), **more}


def node_name(config: Config) -> str:
    """The node the rank runs on: Kubernetes' (``K8S_NODE_NAME``, or ``k8s.node.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES``: the downward API's ``spec.nodeName``), else the host name."""
    return (os.environ.get("K8S_NODE_NAME") or dict(config.resource_attributes).get("k8s.node.name")
            or socket.gethostname())


def dump_entries(ring: Ring) -> int:
    """How many collectives a rank's flight-recorder dumps hold: as many as ``ring`` keeps, up to 2048."""
    return min(2048, ring.slots // 2)
