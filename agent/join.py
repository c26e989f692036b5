"""The START/END join: what each record a drain reads means for the rank's telemetry. A START enters
the in-flight table and counts as issued; an END leaves it, counts as completed and becomes a span where
one is kept (every anomaly, and what ``sample`` keeps); a fold's run of collectives counts at once; NAN and
loss-scale records feed the non-finite tracking; a watch finds what hung. The drain loop (agent/sidecar.py)
reads and locks; this decides.

Example::

    join = RecordJoin(ring, rank=0, hang_threshold_s=60, stats=Stats(), on_collective=spans.queue)
    snapshots = []
    join.handle(records, folded, snapshots)   # under stats.lock
    hung = join.watch(time.monotonic_ns())
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

from commlens.exporters.telemetry import Collective
from commlens.ring.layout import (BUCKET_BITS, END, FINGERPRINT, FLAG_LAST_BUCKET, GPU_START, LOSS_SCALE, LOSS_SCALE_EVENTS,
                                  NAN, NAN_OUTPUT, NOT_ISSUED, REASONS, SNAPSHOT, START, STATUS, Record, bucket_of,
                                  exponent_of)
from commlens.ring.memory import Ring
from commlens.ring.ops import OPS
from commlens.ring.reader import Folded

from .inflight import InFlight
from .nonfinite import LossScaleHold, NonfiniteInputs, kinds
from .outliers import SlowOutliers
from .scales import BucketScales
from .shapes import Shapes
from .stats import Stats

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


def _put_bounded(table: dict, op_id: int, value: object, most: int) -> None:
    """``table[op_id] = value``, an op's until its END; past ``most`` entries (ENDs lost: counted as records
    dropped) the oldest is let go of."""
    table[op_id] = value
    if len(table) > most:
        del table[next(iter(table))]


def keep_all(pg: str, seqs: Sequence[int], is_p2p: bool) -> list[int]:
    """The default sampler: every collective of ``seqs`` is kept (by index)."""
    return list(range(len(seqs)))


class RecordJoin:
    def __init__(self, ring: Ring, rank: int, hang_threshold_s: float, stats: Stats,
                 on_collective: Callable[[Collective], None], slow_factor: float = 5.0,
                 sample: Callable[[str, Sequence[int], bool], list[int]] = keep_all, detail: str = "full",
                 hand_over: Callable[[], None] = lambda: None):
        """``hand_over``: called every ``_BUILT_BETWEEN_HAND_OVERS`` spans built from one fold (the drain
        loop's hand-over of the GIL)."""
        self.stats, self.sample, self._hand_over = stats, sample, hand_over
        self.shapes = Shapes(ring, rank, detail)
        self.inflight = InFlight(ring.slots, hang_threshold_s, self.shapes)
        self.outliers = SlowOutliers(slow_factor)
        self.hold = LossScaleHold(stats, on_collective)
        self.inputs = NonfiniteInputs(stats, self.shapes, self.hold)
        self.nan: dict[int, int] = {}
        """op_id -> NAN_HAS_NAN | NAN_HAS_INF seen for it (its input's, while its collective is read)."""
        self._nan_spans: collections.Counter[str] = collections.Counter()
        """Group -> spans of non-finite collectives kept so far (``NAN_SPANS_KEPT``)."""
        self.fingerprints: dict[int, int] = {}
        """op_id -> its result's fingerprint, until its END (its span is kept: after the fact, the ranks'
        fingerprints are compared from their spans); at most as many as can be in flight."""
        self.scales = BucketScales()
        self.ddp_steps: collections.Counter[str] = collections.Counter()
        """Group -> DDP steps of its followed buckets seen (counted at each step's last bucket): the same
        number on every replica, whose steps are compared."""
        self.scale_jumps: dict[int, tuple[int, int]] = {}
        """op_id -> (by how many binary orders its DDP bucket jumped, the step; ``agent/scales.py``), until its
        END (its span is kept); at most as many as can be in flight."""

    def handle(self, records: list[Record], folded: list[Folded], snapshots: list[str]) -> None:
        """One read's records, then its folds; the snapshots asked for go to ``snapshots``."""
        if self.nan or any(group.nan for group in folded) or any(record.kind == NAN for record in records):
            self.inputs.read(records, folded, self.nan, self.inflight.table)
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
            elif record.kind == FINGERPRINT:
                self.stats.fingerprint(self.shapes.group(record.pg)[0], record.seq, OPS[record.op].value, record.aux,
                                       record.nbytes)
                _put_bounded(self.fingerprints, record.op_id, record.nbytes, self.inflight.slots)
        for group in folded:
            self._folded(group)

    def _started(self, record: Record) -> None:
        forgotten = self.inflight.started(record)
        if forgotten is not None:  # its END was lost
            self.nan.pop(forgotten, None)
        shape = self.shapes.known.get((record.op, record.pg, record.nbytes, record.sig)) or self.shapes.of(record)
        if not shape.is_p2p:
            self.stats.enqueued(shape, record.seq)
        else:
            self.inputs.p2p_issued[(shape.pg, self.shapes.global_rank(record.pg, record.peer), shape.op)] += 1
        pending = self.inputs.pending
        if pending and record.op_id in pending:
            self.inputs.issued(record.op_id)
        if record.aux >> BUCKET_BITS:  # a DDP bucket's, with its scale
            self._scaled(shape.pg, record)

    def _scaled(self, pg: str, start: Record) -> None:
        grown = self.scales.seen((pg, bucket_of(start.aux), start.nbytes), exponent_of(start.aux))
        step = self.ddp_steps[pg]
        if start.flags & FLAG_LAST_BUCKET:
            self.ddp_steps[pg] += 1
        self.stats.scale(pg, start.seq, step, grown, (start.t_ns + self.shapes.ring.clock_offset_ns) / 1e9)
        if grown is not None:
            _put_bounded(self.scale_jumps, start.op_id, (grown, step), self.inflight.slots)

    def _ended(self, end: Record) -> None:
        op_id = end.op_id
        start, gpu_start, hung = self.inflight.ended(op_id)
        if end.flags == NOT_ISSUED:
            self.nan.pop(op_id, None)
            self.scale_jumps.pop(op_id, None)
            return
        shape = self.shapes.known.get((end.op, end.pg, end.nbytes, end.sig)) or self.shapes.of(end)
        status = STATUS[end.flags] if end.flags < len(STATUS) else "error"
        seconds = (end.t_ns - start.t_ns) / 1e9 if start is not None else None
        nan = self.nan.pop(op_id, 0) if self.nan else 0  # the checks first: these are rare
        fingerprint = self.fingerprints.pop(op_id, -1) if self.fingerprints else -1
        scale_jump = self.scale_jumps.pop(op_id, None) if self.scale_jumps else None
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
                or fingerprint >= 0 or scale_jump is not None or self.sample(shape.pg, (end.seq,), shape.is_p2p)):
            return
        first = start or end
        self.hold.emit(self.shapes.collective(shape, first, end, status, nan, hung, slow, gpu_start=gpu_start,
                                              marks=self.inputs.marks_of(first.op_id), fingerprint=fingerprint,
                                              scale_jump=scale_jump), nan)

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
            self.nan[record.op_id] = self.nan.get(record.op_id, 0) | record.flags
        self.stats.nonfinite(shape, record.seq, kinds(record.flags), not record.flags & NAN_OUTPUT,
                             self.hold.step is not None)

    def watch(self, now_ns: int) -> list[Collective]:
        """The collectives found hung since the last watch, counted, as their spans."""
        hung = []
        for op_id, start in self.inflight.overdue(now_ns):
            shape = self.shapes.of(start)
            self.stats.hangs[shape.counter_key] += 1
            hung.append(self.shapes.collective(shape, start, None, "in_flight", self.nan.get(op_id, 0), True, False,
                                               now_ns, marks=self.inputs.marks_of(op_id)))
        return hung
