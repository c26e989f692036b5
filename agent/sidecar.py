"""The sidecar: drains the ring on a thread (or when asked), a run of records at a time, under the
stats' lock, handing the GIL back to training between runs; what the records mean is the START/END
join's (agent/join.py), which feeds ``Stats`` (metrics) and ``on_collective`` (spans: every anomaly, and
what ``sample`` keeps). It reads only the ring, so it runs beside training or in another process
(agent/pod.py). See docs/running.md, and docs/performance.md for the fold (``RingReader.read_folded``).

Example::

    sidecar = Sidecar(ring, rank=0, hang_threshold_s=60, on_collective=spans.queue, sample=spans.sampled)
    sidecar.start(interval_s=0.5)   # and whenever a quarter of the ring has filled
    ...
    sidecar.stop()          # drains what is left
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from commlens.exporters.telemetry import HAND_OVER_S, Collective, GroupInFlight
from commlens.ring.layout import Record
from commlens.ring.memory import Ring
from commlens.ring.reader import Folded, RingReader

from .join import RecordJoin, keep_all
from .stats import Stats

READ_AT_ONCE = 256
"""Records a drain reads and handles at once (~0.1 ms, folded; bench/drain.py) before the next run."""
AFTER_NAN = 8
"""Records read one at a time after a read that ended between a NAN record and its collective's START
(an overflow storm's collectives each have one): the START and END come next, then folded reads again."""


class Sidecar:
    def __init__(self, ring: Ring, rank: int, hang_threshold_s: float, slow_factor: float = 5.0,
                 on_collective: Callable[[Collective], None] = lambda c: None,
                 on_hang: Callable[[Collective], None] = lambda c: None,
                 on_snapshot: Callable[[str], None] = lambda reason: None, stats: Stats | None = None,
                 resume: bool = False, sample: Callable[[str, Sequence[int], bool], list[int]] = keep_all,
                 detail: str = "full", beside_training: bool = False):
        self.ring = ring
        self._hand_over_s = HAND_OVER_S if beside_training else 0.0
        """``beside_training``: in the training process, where a long stretch holding the GIL delays training."""
        self.reader = RingReader(ring, ring.cursor if resume else 0)
        self.stats = stats or Stats()
        self.on_collective, self.on_hang, self.on_snapshot = on_collective, on_hang, on_snapshot
        self.join = RecordJoin(ring, rank, hang_threshold_s, self.stats, on_collective, slow_factor, sample, detail,
                               self._hand_over)
        self.shapes = self.join.shapes
        self.pollers: list[Callable[[], None]] = []
        """Called before each drain: what completes collectives from outside the ring (the GPU's events)."""
        self._nan_since: int | None = None
        """The reader's cursor when a NAN record began to wait for its collective's START."""
        self._stop = threading.Event()
        self._draining = threading.RLock()
        self._thread: threading.Thread | None = None
        if resume and self.reader.cursor > 0:  # what was in flight at the cursor, from the records before it
            before = RingReader(ring, max(0, self.reader.cursor - ring.slots))
            self.join.inflight.resume(before.read(self.reader.cursor - before.cursor), time.monotonic_ns())

    def start(self, interval_s: float) -> None:
        """Drain on a thread every ``interval_s`` (at most a quarter of the hang threshold), and as soon
        as producers in this process have filled a quarter of the ring (``Ring.wake_reader``)."""
        interval_s = min(interval_s, self.join.inflight.threshold_ns / 4e9)
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
            self.join.hold.writer_ended()

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
                self.join.handle(records, folded, snapshots)
                if not more:
                    hung = self.join.watch(time.monotonic_ns())
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

    def _read(self) -> tuple[list[Record], list[Folded], int]:
        """The next records, with the collectives that started and ended ok among them folded (on a GPU
        too), and how many were asked for: ``READ_AT_ONCE``; only ``AFTER_NAN``, none folded, while a
        NAN record read before waits for its collective's START (its START and END could both be in
        this read, and fold without it; they come next)."""
        nan = self.join.nan
        waiting = nan.keys() - self.join.inflight.table.keys() if nan else ()
        if waiting:
            self._nan_since = self.reader.cursor if self._nan_since is None else self._nan_since
            if self.reader.cursor - self._nan_since <= READ_AT_ONCE:
                return self.reader.read(AFTER_NAN), [], AFTER_NAN
            for op_id in waiting:  # its START was written over before it was read (counted as dropped)
                del nan[op_id]
        self._nan_since = None
        return *self.reader.read_folded(READ_AT_ONCE), READ_AT_ONCE

    def inflight_by_group(self) -> dict[str, GroupInFlight]:
        """Group name -> its collectives in flight, computed now."""
        return self.join.inflight.by_group(time.monotonic_ns(), self.stats.lock)
