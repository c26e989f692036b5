"""The collectives a rank has issued and not ended, as its ring's records tell them: the START/END join's
table (bounded by the ring's size), when each started on a GPU, and which are past the hang threshold —
each found hung once (``overdue``), and each group's view at a scrape (``by_group``).

Example::

    inflight = InFlight(slots=ring.slots, hang_threshold_s=300, shapes=shapes)
    inflight.started(start)
    for op_id, start in inflight.overdue(time.monotonic_ns()): ...   # hung since the last watch
    start, gpu_start, hung = inflight.ended(end.op_id)
"""

from __future__ import annotations

import threading
from typing import Iterable

from commlens.exporters.telemetry import GroupInFlight
from commlens.ring.layout import END, START, Record
from commlens.ring.ops import OPS

from .shapes import Shapes


class InFlight:
    def __init__(self, slots: int, hang_threshold_s: float, shapes: Shapes):
        self.slots, self.shapes = slots, shapes
        self.threshold_ns = int(hang_threshold_s * 1e9)
        self.table: dict[int, Record] = {}
        """op_id -> its START, in the order issued."""
        self.gpu_start: dict[int, int] = {}
        """op_id -> the time its collective started on the GPU."""
        self.hung: set[int] = set()
        """The op ids found past the hang threshold (each counted once)."""

    def started(self, record: Record) -> int | None:
        """``record`` (a START) is in flight; returns the op id forgotten to make room, if any (the
        oldest: its END was lost)."""
        table, oldest = self.table, None
        if len(table) >= self.slots:
            oldest = next(iter(table))  # op ids grow in the order records are inserted: O(1)
            del table[oldest]
            self.gpu_start.pop(oldest, None)
            self.hung.discard(oldest)
        table[record.op_id] = record
        return oldest

    def ended(self, op_id: int) -> tuple[Record | None, int | None, bool]:
        """``op_id`` ended: its START (None where it was lost), when it started on a GPU, and whether it
        was found hung."""
        start = self.table.pop(op_id, None)
        hung = op_id in self.hung if self.hung else False
        if hung:
            self.hung.discard(op_id)
        return start, self.gpu_start.pop(op_id, None) if self.gpu_start else None, hung

    def resume(self, records: Iterable[Record], now_ns: int) -> None:
        """What was in flight at a restarted reader's cursor, from the ``records`` before it; those already
        past the hang threshold were counted as hung by the reader before."""
        for record in records:
            if record.kind == START:
                self.table[record.op_id] = record
            elif record.kind == END:
                self.table.pop(record.op_id, None)
        self.hung.update(op_id for op_id, start in self.table.items() if now_ns - start.t_ns >= self.threshold_ns)

    def overdue(self, now_ns: int) -> list[tuple[int, Record]]:
        """The collectives past the hang threshold at ``now_ns`` not found so before (on a GPU: from when
        they started there), now found."""
        found = []
        for op_id, start in self.table.items():
            since = self.gpu_start.get(op_id, start.t_ns)
            if op_id not in self.hung and now_ns - since >= self.threshold_ns:
                self.hung.add(op_id)
                found.append((op_id, start))
        return found

    def by_group(self, now_ns: int, lock: threading.RLock | threading.Lock) -> dict[str, GroupInFlight]:
        """Group name -> its collectives in flight at ``now_ns``, read under ``lock`` (the drain's)."""
        shapes = self.shapes
        counts: dict[str, int] = {name: 0 for name, _ in shapes.groups.values()}
        oldest: dict[str, int] = {}
        oldest_collective: dict[str, tuple[int, Record]] = {}
        oldest_p2p: dict[str, tuple[int, Record]] = {}
        with lock:
            for op_id, start in self.table.items():
                name = shapes.group(start.pg)[0]
                since = self.gpu_start.get(op_id, start.t_ns)  # on a GPU: from when it started there
                counts[name] = counts.get(name, 0) + 1
                oldest[name] = min(oldest.get(name, since), since)
                kind = oldest_p2p if OPS[start.op].is_p2p else oldest_collective
                if since < kind.get(name, (since + 1,))[0]:
                    kind[name] = (since, start)
        found = {}
        for name, count in counts.items():
            age = (now_ns - oldest[name]) / 1e9 if name in oldest else 0.0
            since, hung = oldest_collective.get(name, (now_ns, None))
            hung_op, hung_seq, hung_bytes = (OPS[hung.op].value, hung.seq, hung.nbytes) \
                if hung and now_ns - since >= self.threshold_ns else (None, None, None)
            since, p2p = oldest_p2p.get(name, (now_ns, None))
            p2p_hung = (OPS[p2p.op].value, shapes.global_rank(p2p.pg, p2p.peer), (now_ns - since) / 1e9) \
                if p2p and now_ns - since >= self.threshold_ns else None
            found[name] = GroupInFlight(count, age, hung_op, hung_seq, p2p_hung, hung_bytes)
        return found
