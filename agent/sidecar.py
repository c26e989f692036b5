"""The sidecar: drains the ring, joins START and END, keeps the in-flight table, watches for hangs,
and feeds ``Stats`` (metrics) and ``on_collective`` (spans: every anomaly, and what ``sample`` keeps).
It reads only the ring, so it runs beside training or in another process (agent/pod.py); what the
records mean is ``shapes.Shapes``', what is in flight and hung ``inflight.InFlight``', which collectives
are slow ``outliers.SlowOutliers``', where NaN or Inf entered and what a loss scaler's step holds
``nonfinite``'s. See
docs/running.md, and docs/performance.md for the fold (``RingReader.read_folded``).

Example::

    sidecar = Sidecar(ring, rank=0, hang_threshold_s=60, on_collective=spans.queue, sample=spans.sampled)
    sidecar.start(interval_s=0.5)   # and whenever a quarter of the ring has filled
    ...
    sidecar.stop()          # drains what is left
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Sequence

from commlens.exporters.telemetry import HAND_OVER_S, Collective, GroupInFlight
from commlens.hooks.ring import (END, GPU_START, LOSS_SCALE, LOSS_SCALE_EVENTS, NAN, NAN_OUTPUT, NOT_ISSUED, REASONS,
                                 SNAPSHOT, START, STATUS, Folded, Record, Ring, RingReader)

from .outliers import SlowOutliers
from .inflight import InFlight
from .nonfinite import LossScaleHold, NonfiniteInputs, kinds
from .shapes import Shapes
from .stats import Stats

READ_AT_ONCE = 256
"""Records a drain reads and handles at once (~0.1 ms, folded; bench/drain.py) before the next run."""
AFTER_NAN = 8
"""Records read one at a time after a read that ended between a NAN record and its collective's START
(an overflow storm's collectives each have one): the START and END come next, then folded reads again."""
_BUILT_BETWEEN_HAND_OVERS = 32
"""Collectives a drain builds (~3 µs each: every span kept) between two hand-overs of the GIL."""

NAN_SPANS_KEPT = 100
"""Spans of collectives with a non-finite tensor kept whatever the sampling, per group: the first ones,
where values entered. Past that many they are sampled like the others (every one still counted in
``commlens_nan_events_total``), so that a job whose every collective holds NaN or Inf (diverged, an
overflow storm) does not have each one built and exported."""


def _within(gpu_start_ns: int, start: Record, end: Record) -> int:
    """A GPU start time within its collective's START and END: the clocks' alignment error taken out
    (``fold_run`` clamps the same way)."""
    return min(max(gpu_start_ns, start.t_ns), end.t_ns)


def _keep_all(pg: str, seqs: Sequence[int], is_p2p: bool) -> list[int]:
    """The default sampler: every collective of ``seqs`` is kept (by index)."""
    return list(range(len(seqs)))


class Sidecar:
    def __init__(self, ring: Ring, rank: int, hang_threshold_s: float, slow_factor: float = 5.0,
                 on_collective: Callable[[Collective], None] = lambda c: None,
                 on_hang: Callable[[Collective], None] = lambda c: None,
                 on_snapshot: Callable[[str], None] = lambda reason: None, stats: Stats | None = None,
                 resume: bool = False, sample: Callable[[str, Sequence[int], bool], list[int]] = _keep_all,
                 detail: str = "full", beside_training: bool = False):
        self.ring = ring
        self.shapes = Shapes(ring, rank, detail)
        self._hand_over_s = HAND_OVER_S if beside_training else 0.0
        """``beside_training``: in the training process, where a long stretch holding the GIL delays training."""
        self.reader = RingReader(ring, ring.cursor if resume else 0)
        self.stats = stats or Stats()
        self.outliers = SlowOutliers(slow_factor)
        self.on_collective, self.on_hang, self.on_snapshot, self.sample = on_collective, on_hang, on_snapshot, sample
        self.inflight = InFlight(ring.slots, hang_threshold_s, self.shapes)
        self.pollers: list[Callable[[], None]] = []
        """Called before each drain: what completes collectives from outside the ring (the GPU's events)."""
        self._nan: dict[int, int] = {}
        """op_id -> NAN_HAS_NAN | NAN_HAS_INF seen for it."""
        self._nan_since: int | None = None
        """The reader's cursor when a NAN record began to wait for its collective's START."""
        self.hold = LossScaleHold(self.stats, lambda c: self.on_collective(c))  # the callback as set now
        self.inputs = NonfiniteInputs(self.stats, self.shapes, self.hold)
        self._nan_spans: collections.Counter[str] = collections.Counter()
        """Group -> spans of non-finite collectives kept so far (``NAN_SPANS_KEPT``)."""
        self._stop = threading.Event()
        self._draining = threading.RLock()
        self._thread: threading.Thread | None = None
        if resume and self.reader.cursor > 0:
            self._resume()

    # -- the loop -----------------------------------------------------------------------------------

    def start(self, interval_s: float) -> None:
        """Drain on a thread every ``interval_s`` (at most a quarter of the hang threshold), and as soon
        as producers in this process have filled a quarter of the ring (``Ring.wake_reader``)."""
        interval_s = min(interval_s, self.inflight.threshold_ns / 4e9)
        self._wakeup = self.ring.wake_reader()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="commlens-sidecar", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and drain what the ring still holds."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            self._wakeup.set()
            thread.join(timeout_s)
            if not thread.is_alive():  # else it may still wait on the pipe: left open
                self._wakeup.close()
        self.drain()
        self.writer_ended()

    def writer_ended(self) -> None:
        """The ring's writer will write no more (its process ended, or stopped recording): a loss
        scaler's step it never ended keeps its non-finite values as evidence of values entering."""
        with self._draining, self.stats.lock:
            self.hold.writer_ended()

    def _run(self, interval_s: float) -> None:
        while True:
            self._wakeup.wait(interval_s)
            if self._stop.is_set():
                return
            self.drain()

    def drain(self, blocking: bool = True) -> int:
        """Read every new record, then run the watchdog; returns how many records were read.
        Safe from any thread (a snapshot drains before it flushes); ``blocking=False`` (a signal's
        snapshot) reads nothing and returns 0 rather than wait for a lock another thread holds."""
        if not self._draining.acquire(blocking):
            return 0
        try:
            return self._drain(blocking)
        finally:
            self._draining.release()

    def _drain(self, blocking: bool) -> int:
        if blocking:
            for poll in self.pollers:
                poll()
        snapshots: list[str] = []
        hung: list[Collective] = []
        handled, more = 0, True
        while more:  # a run of READ_AT_ONCE records at a time, each holding the GIL ~0.1 ms
            cursor = self.reader.cursor
            records, folded, limit = self._read() if blocking else (None, None, 0)
            if not self.stats.lock.acquire(blocking):
                return handled  # nothing read this time: nothing lost
            try:
                if records is None:
                    records, folded, limit = self._read()
                more = self.reader.cursor - cursor >= limit
                self.ring.cursor = self.reader.cursor  # before handling them: a restarted sidecar counts none twice
                self._handle(records, folded, snapshots)
                if not more:
                    hung = self._watch(time.monotonic_ns())
            finally:
                self.stats.lock.release()
            handled += len(records) + sum(group.record_count() for group in folded)
            if more:
                self._hand_over()
        for collective in hung:
            self.on_collective(collective)
        if hung:
            self.on_hang(hung[0])
        for reason in dict.fromkeys(snapshots):
            self.on_snapshot(reason)
        return handled

    def _hand_over(self) -> None:
        """Let a thread waiting for the GIL (training) have it, unless more than half the ring is
        unread: then the drain catches up first (docs/performance.md, "The GIL")."""
        if self._hand_over_s and self.ring.claimed() - self.reader.cursor < self.ring.slots // 2:
            time.sleep(self._hand_over_s)

    def _handle(self, records: list[Record], folded: list[Folded], snapshots: list[str]) -> None:
        if self._nan or any(group.nan for group in folded) or any(record.kind == NAN for record in records):
            self.inputs.read(records, folded, self._nan, self.inflight.table)
        started, ended = self._started, self._ended
        for record in records:
            kind = record[1]
            if kind == START:
                started(record)
            elif kind == END:
                ended(record)
            elif kind == NAN:
                self._nan_found(record)
            elif record.kind == GPU_START:
                self.inflight.gpu_start[record.op_id] = record.t_ns
            elif record.kind == SNAPSHOT and record.flags < len(REASONS):
                snapshots.append(REASONS[record.flags])
            elif record.kind == LOSS_SCALE and record.flags < len(LOSS_SCALE_EVENTS):
                self.hold.event(LOSS_SCALE_EVENTS[record.flags])
        for group in folded:
            self._folded(group)

    def _read(self) -> tuple[list[Record], list[Folded], int]:
        """The next records, with the collectives that started and ended ok among them folded (on a GPU
        too), and how many were asked for: ``READ_AT_ONCE``; only ``AFTER_NAN``, none folded, while a
        NAN record read before waits for its collective's START (its START and END could both be in
        this read, and fold without it; they come next)."""
        waiting = self._nan.keys() - self.inflight.table.keys() if self._nan else ()
        if waiting:
            self._nan_since = self.reader.cursor if self._nan_since is None else self._nan_since
            if self.reader.cursor - self._nan_since <= READ_AT_ONCE:
                return self.reader.read(AFTER_NAN), [], AFTER_NAN
            for op_id in waiting:  # its START was written over before it was read (counted as dropped)
                del self._nan[op_id]
        self._nan_since = None
        return *self.reader.read_folded(READ_AT_ONCE), READ_AT_ONCE

    def _resume(self) -> None:
        """The collectives in flight at the cursor, from the records before it still in the ring;
        those already past the hang threshold were counted as hung by the sidecar before."""
        cursor = self.reader.cursor
        before = RingReader(self.ring, max(0, cursor - self.ring.slots))
        self.inflight.resume(before.read(cursor - before.cursor), time.monotonic_ns())

    # -- records ------------------------------------------------------------------------------------

    def _started(self, record: Record) -> None:
        forgotten = self.inflight.started(record)
        if forgotten is not None:  # its END was lost
            self._nan.pop(forgotten, None)
        shape = self.shapes.known.get((record.op, record.pg, record.nbytes, record.sig)) or self.shapes.of(record)
        if not shape.is_p2p:
            self.stats.enqueued(shape, record.seq)
        else:
            self.inputs.p2p_issued[(shape.pg, self.shapes.global_rank(record.pg, record.peer), shape.op)] += 1
        pending = self.inputs.pending
        if pending and record.op_id in pending:
            self.inputs.issued(record.op_id)

    def _ended(self, end: Record) -> None:
        op_id = end.op_id
        start, gpu_start, hung = self.inflight.ended(op_id)
        if end.flags == NOT_ISSUED:
            self._nan.pop(op_id, None)
            return
        shape = self.shapes.known.get((end.op, end.pg, end.nbytes, end.sig)) or self.shapes.of(end)
        status = STATUS[end.flags] if end.flags < len(STATUS) else "error"
        seconds = (end.t_ns - start.t_ns) / 1e9 if start is not None else None
        nan = self._nan.pop(op_id, 0) if self._nan else 0  # the checks first: these are rare
        if gpu_start is not None and start is not None:
            gpu_start = _within(gpu_start, start, end)
            self.stats.on_gpu(shape, (gpu_start - start.t_ns) / 1e9, (end.t_ns - gpu_start) / 1e9)
        self.stats.finished(shape, None if shape.is_p2p else end.seq, status, seconds)
        if shape.is_p2p and status != "ok":
            self.stats.p2p_failed_on(shape, end.seq, self.shapes.global_rank(end.pg, end.peer))
        slow = seconds is not None and bool(self.outliers.among(shape.typical_key, (seconds,)))
        if nan:
            self._nan_spans[shape.pg] += 1
        if not (nan and self._nan_spans[shape.pg] <= NAN_SPANS_KEPT or hung or slow or status != "ok"
                or self.sample(shape.pg, (end.seq,), shape.is_p2p)):
            return
        first = start or end
        self.hold.emit(self.shapes.collective(shape, first, end, status, nan, hung, slow, gpu_start=gpu_start,
                                              marks=self.inputs.marks_of(first.op_id)), nan)

    def _folded(self, group: Folded) -> None:
        """Collectives of one shape that started and ended ok within this drain: counted at once; the
        slow ones, those sampled and, of a group whose inputs held NaN or Inf, the first kept of their
        process group (``NAN_SPANS_KEPT``) are built from their records."""
        shape = self.shapes.known.get((group.op, group.pg, group.nbytes, group.sig)) or self.shapes.of(group)
        seqs, seconds = group.seqs(), group.seconds()
        self.stats.completed_ok(shape, seqs, seconds)
        if shape.is_p2p:  # one peer's (the fold keys on it)
            self.inputs.p2p_issued[(shape.pg, self.shapes.global_rank(group.pg, group.records(0)[0].peer), shape.op)] += len(seqs)
        first_nan = range(0)  # of the group's collectives, those whose spans are kept for their NaN or Inf
        if group.nan:
            self.stats.nonfinite(shape, min(seqs), kinds(group.nan), True, self.hold.step is not None, len(seqs))
            first_nan = range(max(0, min(len(seqs), NAN_SPANS_KEPT - self._nan_spans[shape.pg])))
            self._nan_spans[shape.pg] += len(seqs)
        if group.gpu_bytes:
            queued, executing = group.gpu_seconds()
            self.stats.on_gpu(shape, sum(queued), sum(executing))
        slow = self.outliers.among(shape.typical_key, seconds)
        special = slow.union(first_nan)  # kept whatever the sampler says, and not offered to it
        ordinary = range(len(seqs)) if not special else [k for k in range(len(seqs)) if k not in special]
        kept = self.sample(shape.pg, seqs if not special else [seqs[k] for k in ordinary], shape.is_p2p)
        built = special.union(ordinary[i] for i in kept) if kept or special else ()
        for n, k in enumerate(sorted(built)):
            if n % _BUILT_BETWEEN_HAND_OVERS == _BUILT_BETWEEN_HAND_OVERS - 1:
                self._hand_over()
            records = group.records(k)
            start, end = records[0], records[-1]
            gpu_start = _within(records[1].t_ns, start, end) if len(records) == 3 else None
            self.hold.emit(self.shapes.collective(shape, start, end, "ok", group.nan, False, k in slow,
                                                  gpu_start=gpu_start, marks=self.inputs.marks_of(start.op_id)),
                           group.nan)

    def _nan_found(self, record: Record) -> None:
        shape = self.shapes.of(record)
        if not record.flags & NAN_OUTPUT:  # an output's comes after its END (a post-hook's): nothing waits for it
            self._nan[record.op_id] = self._nan.get(record.op_id, 0) | record.flags
        self.stats.nonfinite(shape, record.seq, kinds(record.flags), not record.flags & NAN_OUTPUT,
                             self.hold.step is not None)

    def _watch(self, now_ns: int) -> list[Collective]:
        """The collectives found hung since the last watch, counted, as their spans."""
        hung = []
        for op_id, start in self.inflight.overdue(now_ns):
            shape = self.shapes.of(start)
            self.stats.hangs[shape.counter_key] += 1
            hung.append(self.shapes.collective(shape, start, None, "in_flight", self._nan.get(op_id, 0), True, False,
                                               now_ns, marks=self.inputs.marks_of(op_id)))
        return hung

    # -- scrape-time values -------------------------------------------------------------------------

    def inflight_by_group(self) -> dict[str, GroupInFlight]:
        """Group name -> its collectives in flight, computed now."""
        return self.inflight.by_group(time.monotonic_ns(), self.stats.lock)
