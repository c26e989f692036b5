"""Prometheus metrics: the families of docs/metrics.md, built at scrape time from what the sidecar counted.

``MetricsCollector.collect()`` reads one rank's ``RankTelemetry`` (a copy of its counters, the ages
and depths of its collectives in flight at that moment); ``PodCollector`` serves several ranks' on
one endpoint (the pod sidecar), each series labelled by its rank; ``serve()`` puts either on its own registry behind
prometheus-client's HTTP server.

Example::

    server = serve(MetricsCollector(rank_telemetry, DURATION_BUCKETS), "0.0.0.0", 9464)
    ...
    server.shutdown()
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Any, Callable, Mapping

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Exemplar

from commlens.ring.layout import ERRORS, REASONS

from . import names
from .otlp import trace_id, trace_scope
from .telemetry import RankTelemetry


SPAN_RESULTS = ("exported", "failed", "dropped", "sampled_out")
NONFINITE_KINDS = ("nan", "inf")


class _Scrapes:
    """Numbers scrapes as they start, so that the way down can wait for one that started after it. A
    scrape over HTTP (``serve``) is done once its response is sent: a process that exits right after
    (SIGTERM's default, re-raised once its snapshot is scraped) does not cut it off. One sent after half
    the scraper's timeout (Prometheus says it in ``X-Prometheus-Scrape-Timeout-Seconds``) is not done:
    the scraper may have given up on it and recorded the endpoint down, and a rank's last values with
    it (its clock started before this process took the connection, by as long as a busy GIL holds it)."""

    def __init__(self) -> None:
        self.started = 0
        self.done = 0
        """The number of the latest scrape done (each one's number is its place in starting order)."""
        self.scraped = threading.Condition()
        self._unsent = threading.local()
        """In a thread that serves a scrape (``serving``): the scrapes it read, not yet sent."""

    def wait_for_scrape(self, timeout_s: float) -> bool:
        """Wait until a scrape that starts after this call has read the metrics (on the way down: the
        final values reach Prometheus; one under way when called read earlier ones); False after
        ``timeout_s``, or at once when nothing has ever scraped."""
        with self.scraped:
            after = self.started
            return after > 0 and self.scraped.wait_for(lambda: self.done > after, timeout_s)

    def collect(self):
        with self.scraped:
            self.started += 1
            number = self.started
        yield from self.families()
        unsent = getattr(self._unsent, "numbers", None)
        if unsent is None:  # read in this process: done
            self._done(number)
        else:
            unsent.append(number)

    def serving(self) -> None:
        """This thread serves a scrape over HTTP: what it reads is done once ``sent`` in time."""
        self._unsent.numbers = []
        self._unsent.since = time.monotonic()

    def sent(self, timeout_s: float | None = None) -> None:
        """This thread's scrape response is sent (or its connection gone), to a scraper that gives up
        after ``timeout_s`` (None: not said): done unless it took over half of that."""
        numbers = getattr(self._unsent, "numbers", None) or ()
        if timeout_s is None or time.monotonic() - self._unsent.since <= timeout_s / 2:
            for number in numbers:
                self._done(number)
        self._unsent.numbers = None

    def _done(self, number: int) -> None:
        with self.scraped:
            self.done = max(self.done, number)
            self.scraped.notify_all()


class MetricsCollector(_Scrapes):
    """The metrics of one rank, read from ``source`` at each scrape. The histogram counts in
    ``buckets`` and is exposed in ``exposed`` (a subset of ``buckets``, default all of them), each
    exposed bucket with the latest exemplar of the buckets folded into it.

    Counters of rare events (hangs, NaN, snapshots, span results) are shown at 0 for every op and
    group seen, so that ``increase()`` in an alert rule sees the first event.
    """

    def __init__(self, source: RankTelemetry, buckets: tuple[float, ...], exposed: tuple[float, ...] | None = None):
        super().__init__()
        self.source = source
        self.ended = False
        """The rank's process is ending cleanly: its last scrapes say so (``commlens_rank_up`` 0), so that
        an endpoint gone without it tells a rank killed (in-process agent; a pod sidecar says it itself)."""
        self.exposed = buckets if exposed is None else exposed
        if not set(self.exposed) <= set(buckets):
            raise ValueError(f"exposed buckets {self.exposed} are not a subset of the histogram's {buckets}")
        self._into = [bisect.bisect_left(self.exposed, bound) for bound in buckets] + [len(self.exposed)]
        """Index of the exposed bucket each of the histogram's buckets (and +Inf) folds into."""

    def _fold(self, counts: list[int], exemplars: list) -> tuple[list[int], list]:
        if len(self.exposed) + 1 == len(counts):
            return counts, exemplars
        folded, latest = [0] * (len(self.exposed) + 1), [None] * (len(self.exposed) + 1)
        for into, count, exemplar in zip(self._into, counts, exemplars):
            folded[into] += count
            if exemplar is not None and (latest[into] is None or exemplar[0] > latest[into][0]):
                latest[into] = exemplar
        return folded, latest

    def families(self):
        source = self.source
        info = source.info()
        rank, s, inflight = str(info["rank"]), source.stats_snapshot(), source.inflight_by_group()

        family = HistogramMetricFamily(names.COLLECTIVE_DURATION,
                                       "Time from issue to completion of a collective",
                                       labels=("op", "pg", "size_class", "rank"))
        job = trace_scope(str(info["job"]), int(info.get("attempt", 0)))
        for (op, pg, size), (counts, exemplars, total) in sorted(s.durations.items()):
            cumulative, running = [], 0
            counts, exemplars = self._fold(counts, exemplars)
            for bound, count, exemplar in zip((*(repr(float(b)) for b in self.exposed), "+Inf"), counts, exemplars):
                running += count
                if exemplar is None:
                    cumulative.append((bound, running))
                else:  # the latest collective in this bucket, by its trace id (OpenMetrics scrapes only)
                    seq, seconds = exemplar
                    cumulative.append((bound, running, Exemplar({"trace_id": trace_id(job, pg, seq).hex()}, seconds)))
            family.add_metric((op, pg, size, rank), cumulative, total)
        yield family

        yield _counter(names.COLLECTIVES, "Completed collectives, by status", ("op", "pg", "status"), s.completed, rank)
        yield _counter(names.GPU_QUEUE, "Collectives on CUDA tensors: seconds from issue to "
                       "their start on the GPU (the GPU busy with earlier work)", ("op", "pg"), s.gpu_queue, rank)
        yield _counter(names.GPU_EXEC, "Collectives on CUDA tensors: seconds from their start "
                       "on the GPU to their end", ("op", "pg"), s.gpu_exec, rank)
        yield _counter(names.COLLECTIVE_BYTES, "Payload bytes of completed collectives", ("op", "pg"), s.bytes, rank)
        yield _counter(names.COLLECTIVE_BUS_BYTES,
                       "Payload bytes times the nccl-tests bus factor; busbw = rate(bus_bytes) / rate(duration_sum)",
                       ("op", "pg"), s.bus_bytes, rank)
        yield _gauge(names.LAST_SEQ, "Last collective sequence number by state", ("pg", "state"), s.last_seq, rank)
        yield _gauge(names.INFLIGHT, "Collectives issued and not completed", ("pg",),
                     {(pg,): group.count for pg, group in inflight.items()}, rank)
        yield _gauge(names.INFLIGHT_OLDEST, "Age of the oldest in-flight collective, 0 when none", ("pg",),
                     {(pg,): group.oldest_s for pg, group in inflight.items()}, rank)
        yield _gauge(names.HUNG_SEQ, "Sequence number of the oldest collective in flight past the hang threshold, "
                     "by op; absent when none", ("pg", "op"),
                     {(pg, g.hung_op): g.hung_seq for pg, g in inflight.items() if g.hung_seq is not None}, rank)
        yield _gauge(names.HUNG_BYTES, "Payload bytes of that collective (the ranks of an all_reduce, reduce or "
                     "broadcast give alike: one that gives other bytes did not match the others)", ("pg", "op"),
                     {(pg, g.hung_op): g.hung_bytes for pg, g in inflight.items() if g.hung_seq is not None}, rank)
        yield _gauge(names.P2P_HUNG, "Age of the oldest point-to-point op in flight past the hang threshold, by op "
                     "and the global rank it waits on (peer); absent when none", ("pg", "op", "peer"),
                     {(pg, g.p2p_hung[0], str(g.p2p_hung[1])): g.p2p_hung[2]
                      for pg, g in inflight.items() if g.p2p_hung is not None}, rank)
        yield _gauge(names.FAILED_SEQ, "Sequence number of the first collective that failed (error or timeout), "
                     "by op; absent when none", ("pg", "op"),
                     {(pg, op): seq for pg, (seq, op) in s.failed.items()}, rank)
        yield _gauge(names.P2P_FAILED, "The group's sequence number of the first point-to-point op that failed, by op "
                     "and the global rank it was with (peer: its process ended, gloo fails at once); absent when none",
                     ("pg", "op", "peer"), {(pg, op, str(peer)): seq for pg, (seq, op, peer) in s.p2p_failed.items()},
                     rank)
        seen = dict.fromkeys(s.bytes, 0)
        yield _counter(names.HANGS, "In-flight collectives that crossed the hang threshold", ("op", "pg"),
                       {**seen, **s.hangs}, rank)
        yield _counter(names.NAN_EVENTS, "Collectives whose input (or output) held NaN (kind nan) or Inf (kind inf)",
                       ("op", "pg", "kind"), {**{(*k, kind): 0 for k in seen for kind in NONFINITE_KINDS}, **s.nans},
                       rank)
        yield _gauge(names.REPLICA_FINGERPRINT, "A fingerprint of the result of one of the group's last fingerprinted "
                     "collectives (all_reduce, broadcast, all_gather: every member holds the same), by slot; a rank "
                     "whose value differs from its group's at the same sequence number holds a corrupted result",
                     ("pg", "slot"), {key: value for key, (_, value, _) in s.fingerprints.items()}, rank)
        yield _gauge(names.REPLICA_FINGERPRINT_SEQ, "The sequence number of the collective whose fingerprint is in the "
                     "slot, by its op", ("pg", "slot", "op"),
                     {(pg, slot, op): seq for (pg, slot), (seq, _, op) in s.fingerprints.items()}, rank)
        jumps = s.scale_jumps
        yield _counter(names.INPUT_SCALE_JUMPS, "DDP gradient buckets of the group whose largest value grew 256 times "
                       "or more over the bucket's recent scale on this rank (its median of the last 16 steps): a value "
                       "flipped high, or the rank's gradients grown", ("pg",),
                       {(pg,): n for pg, (n, *_) in jumps.items()}, rank)
        for name, field, what in ((names.INPUT_SCALE_JUMP_SEQ, 1, "its collective's sequence number"),
                                  (names.INPUT_SCALE_JUMP_STEP, 2, "its group's DDP step, counted from 0"),
                                  (names.INPUT_SCALE_JUMP_ORDERS, 3, "by how many binary orders the bucket grew")):
            yield _gauge(name, f"The first jump of the latest burst (jumps under a minute apart), where it began: "
                         f"{what} (0: none yet)", ("pg",), {(pg,): jump[field] for pg, jump in jumps.items()}, rank)
        yield _gauge(names.INPUT_SCALE_JUMP_TIME, "The last jump: when its collective was issued, unix seconds "
                     "(0: none yet)", ("pg",), {(pg,): jump[4] for pg, jump in jumps.items()}, rank)
        yield _gauge(names.NONFINITE_FIRST_SEQ, "Sequence number of the first collective whose input held NaN or Inf "
                     "on this rank (outside steps a loss scaler skipped); the lowest across ranks is where the values "
                     "entered", ("pg", "op", "kind"),
                     {(pg, op, kind): seq for (pg, kind), (seq, op) in s.first_nonfinite.items()}, rank)
        yield _gauge(names.NONFINITE_FIRST_SEND, "Of this rank's sends to a peer (global rank) in a group, the number "
                     "of the first whose input held NaN or Inf (1: its first send to that peer)", ("pg", "peer", "kind"),
                     {(pg, str(peer), kind): n for (pg, peer, kind), n in s.first_send.items()}, rank)
        entry = s.nonfinite_entry
        yield _gauge(names.NONFINITE_ENTRY_SEQ, "This rank's first input of all that held NaN or Inf (outside steps a "
                     "loss scaler skipped): its op's sequence number in its group; a send's peer as peer",
                     ("pg", "op", "kind", "peer"),
                     {} if entry is None else {(entry.pg, entry.op, entry.kind, "" if entry.peer < 0 else str(entry.peer)):
                                               entry.seq}, rank)
        yield _gauge(names.NONFINITE_ISSUED_BEFORE, "At this rank's first input that held NaN or Inf: the last "
                     "collective it had issued in each group before it, and (peer) the recvs from each peer",
                     ("pg", "peer"), {} if entry is None else {
                         **{(pg, ""): seq for pg, seq in entry.issued.items()},
                         **{(pg, str(peer)): n for (pg, peer), n in entry.received.items()}}, rank)
        if s.loss_scale_steps:  # a job with a loss scaler: both outcomes, from 0
            yield _counter(names.LOSS_SCALE_STEPS, "Steps a loss scaler (torch.amp.GradScaler) applied, or skipped "
                           "for Inf or NaN in the gradients (their non-finite values were its overflow)", ("outcome",),
                           {(outcome,): s.loss_scale_steps.get(outcome, 0) for outcome in ("applied", "skipped")}, rank)
        yield _counter(names.ABORT_SNAPSHOTS, "Flight-recorder snapshots written on abort, hang, signal, exception, another rank's hang or abort (peer), "
                       "or the end of a rank's process that did not stop commlens (exit: killed, crashed; pod sidecar)",
                       ("reason",), {(reason,): s.snapshots.get(reason, 0) for reason in REASONS}, rank)
        yield _counter(names.RING_RECORDS_DROPPED, "Ring records overwritten before the sidecar read them",
                       (), {(): source.dropped()}, rank)
        yield _counter(names.SPANS_EXPORTED, "Spans handed to OTLP, by result", ("result",),
                       {(result,): n for result, n in {**dict.fromkeys(SPAN_RESULTS, 0), **source.span_results()}.items()},
                       rank)
        yield _counter(names.TELEMETRY_ERRORS, "Telemetry lost inside commlens, by kind: hooks that raised, "
                       "collectives commlens failed to record, strings the ring's table had no room for, async "
                       "works dropped before their completion could be observed", ("kind",),
                       {(kind,): n for kind, n in {**dict.fromkeys(ERRORS, 0), **source.telemetry_errors()}.items()},
                       rank)
        family = GaugeMetricFamily(names.INFO, "Who this is", labels=tuple(info))
        family.add_metric(tuple(str(v) for v in info.values()), 1)
        yield family
        if self.ended:
            yield _gauge(names.RANK_UP, RANK_UP_HELP, (), {(): 0}, rank)


class PodCollector(_Scrapes):
    """The metrics of every rank ``ranks()`` gives (``MetricsCollector``s), merged family by family,
    and ``commlens_rank_up``: whether each rank's process lives (``up()``: rank -> bool)."""

    def __init__(self, ranks: Callable[[], list[MetricsCollector]], up: Callable[[], Mapping[str, bool]]):
        super().__init__()
        self.ranks, self.up = ranks, up

    def families(self):
        merged: dict[str, Any] = {}
        for rank in self.ranks():
            for family in rank.families():
                if (kept := merged.setdefault(family.name, family)) is not family:
                    kept.samples.extend(family.samples)
        yield from merged.values()
        family = GaugeMetricFamily(names.RANK_UP, RANK_UP_HELP, labels=("rank",))
        for rank, alive in sorted(self.up().items(), key=lambda item: int(item[0])):
            family.add_metric((rank,), 1 if alive else 0)
        yield family


RANK_UP_HELP = ("1 while the rank's process lives, 0 after it ended (killed, crashed or done; a pod sidecar's), or "
                "as it ends cleanly (a rank's own endpoint, on its last scrapes); a frozen process counts as living")


def _counter(name: str, documentation: str, labels: tuple[str, ...], values: Mapping[tuple, float], rank: str,
             kind: type = CounterMetricFamily):
    """A family of ``kind`` with a sample per value, labelled by its key's ``labels`` and ``rank``."""
    family = kind(name, documentation, labels=(*labels, "rank"))
    for key, value in sorted(values.items()):
        family.add_metric((*key, rank), value)
    return family


def _gauge(name: str, documentation: str, labels: tuple[str, ...], values: Mapping[tuple, float], rank: str):
    return _counter(name, documentation, labels, values, rank, GaugeMetricFamily)


SCRAPE_IDLE_S = 10.0
"""A scrape's connection idle this long is dropped: how long ``server_close()`` may wait for one."""


SCRAPE_TIMEOUT_HEADER = "X-Prometheus-Scrape-Timeout-Seconds"


def _scrape_timeout_s(handler) -> float | None:
    """How long the scraper of ``handler``'s request waits for its response, when it says (Prometheus does)."""
    said = getattr(handler, "headers", None) and handler.headers.get(SCRAPE_TIMEOUT_HEADER)
    try:
        return float(said) if said else None
    except ValueError:
        return None


def serve(collector: MetricsCollector | PodCollector, addr: str, port: int):
    """Serve ``collector`` on ``addr:port``; returns the server (``shutdown()`` stops it, ``server_close()``
    returns once every scrape under way has its whole response sent; ``wait_for_scrape`` counts a scrape
    once its response is sent in time (``_Scrapes``): the final scrape is not cut off by the process' exit)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    server.daemon_threads = False  # prometheus_client's are, and are then neither tracked nor joined
    base = server.RequestHandlerClass

    def setup(handler) -> None:
        base.setup(handler)
        collector.serving()

    def finish(handler) -> None:
        try:
            base.finish(handler)  # the response flushed
        finally:
            collector.sent(_scrape_timeout_s(handler))

    server.RequestHandlerClass = type("Handler", (base,), {"timeout": SCRAPE_IDLE_S, "setup": setup, "finish": finish})
    threaded = server.process_request

    def process_request(request, client_address) -> None:
        try:
            threaded(request, client_address)
        except RuntimeError:  # no new thread once the interpreter is on its way out (Python 3.12 on): the
            server._threads.reap()  # way down's last scrape, served here; the thread never
            server.process_request_thread(request, client_address)  # started is not one to join

    server.process_request = process_request
    return server
