"""What the sidecar has counted, in the shape of the metrics (docs/metrics.md); read by scrapes and summaries.

The sidecar thread adds under ``lock``; a scrape copies under it. Memory is bounded by the number of
(op, group, size class) combinations, not by how long the job runs.
"""

from __future__ import annotations

import bisect
import collections
import threading
from typing import Sequence

from commlens.exporters.telemetry import BURST_GAP_S, NonfiniteEntry, StatsSnapshot

DURATION_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
SIZE_CLASSES = ((4 << 10, "<=4KiB"), (64 << 10, "<=64KiB"), (1 << 20, "<=1MiB"), (16 << 20, "<=16MiB"),
                (256 << 20, "<=256MiB"))
LARGEST_CLASS = ">256MiB"
DETAILS = ("group", "op", "full")
"""``COMMLENS_METRICS_DETAIL``: what a rank's per-collective series are split by. ``group`` (the
default): per process group, ``op`` and ``size_class`` folded into "all", the ``COARSE_BUCKETS`` of
the latency histogram — a bounded number of series per rank whatever the job does, what the alerts
and the rank drill-downs need. ``op``: per op too. ``full``: per op and size class, every bucket."""
COARSE_BUCKETS = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)
"""The latency buckets exposed below ``full`` detail: a subset of ``DURATION_BUCKETS``, so that their
cumulative counts are exact."""
ALL = "all"
FINGERPRINT_SLOTS = 4
"""A group's last fingerprinted results kept (and exported) per rank: enough that ranks a few collectives
apart still share one sequence number to compare at."""


def size_class(nbytes: int) -> str:
    for limit, name in SIZE_CLASSES:
        if nbytes <= limit:
            return name
    return LARGEST_CLASS


def exposed_buckets(detail: str) -> tuple[float, ...]:
    return DURATION_BUCKETS if detail == "full" else COARSE_BUCKETS


def bus_factor(op: str, group_size: int) -> float:
    """nccl-tests' bus factor: busbw = algbw × this."""
    n = max(group_size, 1)
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op.startswith(("all_gather", "reduce_scatter", "all_to_all")):
        return (n - 1) / n
    return 1.0


class Histogram:
    """Counts per bucket, and per bucket the latest collective that fell in it: ``(seq, seconds)``,
    which the Prometheus exporter shows as an exemplar naming that collective's trace."""

    __slots__ = ("counts", "total", "count", "exemplars")

    def __init__(self) -> None:
        self.counts = [0] * (len(DURATION_BUCKETS) + 1)
        self.exemplars: list[tuple[int, float] | None] = [None] * (len(DURATION_BUCKETS) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, values: Sequence[float], seqs: Sequence[int] | None) -> None:
        """Count each of ``values`` in its bucket, in order; ``seqs``: the collectives they are of, the
        latest in a bucket its exemplar."""
        counts, exemplars, find = self.counts, self.exemplars, bisect.bisect_left
        for k, value in enumerate(values):
            index = find(DURATION_BUCKETS, value)
            counts[index] += 1
            if seqs is not None:
                exemplars[index] = (seqs[k], value)
        self.total += sum(values)
        self.count += len(values)


class Stats:
    """Every counter of a ``StatsSnapshot`` (exporters/telemetry.py says what each holds), kept live."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.durations: dict[tuple[str, str, str], Histogram] = collections.defaultdict(Histogram)
        self.completed: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.bus_bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.last_seq: dict[tuple[str, str], int] = {}
        self.hangs: collections.Counter[tuple[str, str]] = collections.Counter()
        self.nans: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.first_nonfinite: dict[tuple[str, str], tuple[int, str]] = {}
        self.failed: dict[str, tuple[int, str]] = {}
        self.p2p_failed: dict[str, tuple[int, str, int]] = {}
        self.gpu_queue: collections.Counter[tuple[str, str]] = collections.Counter()
        self.gpu_exec: collections.Counter[tuple[str, str]] = collections.Counter()
        self.snapshots: collections.Counter[str] = collections.Counter()
        self.loss_scale_steps: collections.Counter[str] = collections.Counter()
        self._step_first_nonfinite: dict[tuple[str, str], tuple[int, str]] = {}
        """``first_nonfinite`` of the loss scaler's step in progress, until it says whether it skips it."""
        self.fingerprints: dict[tuple[str, str], tuple[int, int, str]] = {}
        self.scale_jumps: dict[str, tuple[int, int, int, int, float]] = {}
        self.first_send: dict[tuple[str, int, str], int] = {}
        self.nonfinite_entry: NonfiniteEntry | None = None
        self._step_first_send: dict[tuple[str, int, str], int] = {}
        self._step_entry: NonfiniteEntry | None = None
        """``first_send`` and ``nonfinite_entry`` of the loss scaler's step in progress."""

    def snapshot(self) -> StatsSnapshot:
        """A copy of every counter, taken under ``lock``: what a scrape exports."""
        with self.lock:
            return StatsSnapshot(
                {key: (list(h.counts), list(h.exemplars), h.total) for key, h in self.durations.items()},
                dict(self.completed), dict(self.bytes), dict(self.bus_bytes), dict(self.last_seq), dict(self.hangs),
                dict(self.nans), dict(self.snapshots), dict(self.first_nonfinite), dict(self.failed),
                dict(self.gpu_queue), dict(self.gpu_exec), dict(self.loss_scale_steps), dict(self.first_send),
                self.nonfinite_entry, dict(self.p2p_failed), dict(self.fingerprints), dict(self.scale_jumps))

    def enqueued(self, shape, seq: int) -> None:
        """A collective of ``shape`` (the sidecar's ``Shape``) was issued."""
        if seq > self.last_seq.get(shape.enqueued_key, -1):
            self.last_seq[shape.enqueued_key] = seq

    def nonfinite(self, shape, seq: int, kinds: tuple[str, ...], is_input: bool, scaled_step: bool = False,
                  count: int = 1) -> None:
        """``count`` collectives of ``shape``, the first ``seq``, had a tensor holding ``kinds`` ("nan",
        "inf"); ``scaled_step``: in a loss scaler's step, whose outcome (``loss_scale_step``) decides
        whether the values entered."""
        first = self._step_first_nonfinite if scaled_step else self.first_nonfinite
        for kind in kinds:
            self.nans[(*shape.counter_key, kind)] += count
            key = (shape.pg, kind)
            if is_input and not shape.is_p2p and seq < first.get(key, (seq + 1,))[0]:
                first[key] = (seq, shape.op)

    def nonfinite_input(self, entry: NonfiniteEntry, send_number: int, scaled_step: bool = False) -> bool:
        """An input held NaN or Inf (``entry``: the op, where the rank had come to in its groups), in the
        order the rank issued them; ``send_number``: a send's number among those to its peer (0: not a
        send). The first of all is the rank's entry; a send's is kept per peer. ``scaled_step``: as
        ``nonfinite``'s. Returns whether it is the entry (in a loss scaler's step: if it applies it)."""
        first = self.nonfinite_entry is None and (not scaled_step or self._step_entry is None)
        if first and scaled_step:
            self._step_entry = entry
        elif first:
            self.nonfinite_entry = entry
        sends = self._step_first_send if scaled_step else self.first_send
        if send_number and (key := (entry.pg, entry.peer, entry.kind)) not in sends:
            sends[key] = send_number
        return first

    def loss_scale_step(self, outcome: str | None) -> None:
        """A loss scaler ended its step (``outcome`` "applied" or "skipped"; None: it never will, the
        process ends): non-finite inputs seen in it entered the job unless it skipped the step, when
        they were its overflow, and only counted."""
        if outcome is not None:
            self.loss_scale_steps[outcome] += 1
        if outcome != "skipped":
            for key, (seq, op) in self._step_first_nonfinite.items():
                if seq < self.first_nonfinite.get(key, (seq + 1,))[0]:
                    self.first_nonfinite[key] = (seq, op)
            self.first_send = {**self._step_first_send, **self.first_send}
            self.nonfinite_entry = self.nonfinite_entry or self._step_entry
        self._step_first_nonfinite.clear()
        self._step_first_send.clear()
        self._step_entry = None

    def fingerprint(self, pg: str, seq: int, op: str, every: int, value: int) -> None:
        """Collective ``seq`` (an ``op``) of group ``pg`` ended holding ``value`` (``hooks/fingerprints.py``), one
        of every ``every``: kept in slot (seq // every) % FINGERPRINT_SLOTS, the same slot on every rank."""
        self.fingerprints[(pg, str(seq // max(every, 1) % FINGERPRINT_SLOTS))] = (seq, value, op)

    def scale(self, pg: str, seq: int, step: int, grown: int | None, time_s: float) -> None:
        """A DDP bucket of group ``pg`` (collective ``seq`` of DDP step ``step``, issued at wall time
        ``time_s``) whose scale this rank follows (``agent/scales.py``): ``grown``, by how many binary orders
        it jumped over its recent scale, or None. Kept: the jumps, the first of the latest burst (its seq,
        step and orders), the last's time."""
        jumps = self.scale_jumps.get(pg, (0, 0, 0, 0, 0.0))
        if grown is not None and time_s - jumps[4] < BURST_GAP_S:  # its burst goes on: its first jump kept
            self.scale_jumps[pg] = (jumps[0] + 1, *jumps[1:4], time_s)
        elif grown is not None:
            self.scale_jumps[pg] = (jumps[0] + 1, seq, step, grown, time_s)
        else:
            self.scale_jumps.setdefault(pg, jumps)

    def on_gpu(self, shape, queue_s: float, exec_s: float) -> None:
        """A collective of ``shape`` waited ``queue_s`` from issue to its start on the GPU, then ran ``exec_s``."""
        self.gpu_queue[shape.counter_key] += max(queue_s, 0.0)
        self.gpu_exec[shape.counter_key] += max(exec_s, 0.0)

    def completed_ok(self, shape, seqs: Sequence[int], seconds: Sequence[float]) -> None:
        """Collectives of ``shape`` issued and completed ok between two drains (``seqs`` in the order
        they ended, ``seconds`` their durations): ``enqueued`` and ``finished`` of each, at once."""
        self._count(shape, shape.ok_key, len(seqs))
        self.durations[shape.duration_key].observe(seconds, None if shape.is_p2p else seqs)
        if not shape.is_p2p:
            last, top = self.last_seq, max(seqs)
            for which in (shape.enqueued_key, shape.completed_key):
                if top > last.get(which, -1):
                    last[which] = top

    def finished(self, shape, seq: int | None, status: str, seconds: float | None) -> None:
        """One collective of ``shape`` (the sidecar's ``Shape``) completed with ``status``."""
        self._count(shape, shape.ok_key if status == "ok" else (*shape.counter_key, status), 1)
        if seconds is not None:
            self.durations[shape.duration_key].observe((seconds,), None if seq is None else (seq,))
        if seq is not None and seq > self.last_seq.get(shape.completed_key, -1):
            self.last_seq[shape.completed_key] = seq
        if seq is not None and status != "ok" and seq < self.failed.get(shape.pg, (seq + 1,))[0]:
            self.failed[shape.pg] = (seq, shape.op)

    def p2p_failed_on(self, shape, seq: int, peer: int) -> None:
        """A point-to-point op of ``shape`` (seq ``seq``, its peer's global rank ``peer``) failed: the
        group's first such is kept."""
        self.p2p_failed.setdefault(shape.pg, (seq, shape.op, peer))

    def _count(self, shape, completed_key: tuple[str, ...], count: int) -> None:
        """``count`` collectives of ``shape`` completed, counted under ``completed_key``, and their bytes."""
        key = shape.counter_key
        self.completed[completed_key] += count
        self.bytes[key] += shape.nbytes * count
        self.bus_bytes[key] += shape.bus_bytes * count
