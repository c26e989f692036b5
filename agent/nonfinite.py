"""Non-finite values as a ring's records tell them: where NaN or Inf entered the rank (``NonfiniteInputs``),
and a loss scaler's step that holds the spans of its non-finite collectives until it says whether it
skipped the step (``LossScaleHold``). The sidecar feeds both as it reads.

Example::

    hold = LossScaleHold(stats, on_collective=spans.queue)
    inputs = NonfiniteInputs(stats, shapes, hold)
    inputs.read(records, folded, flags={op_id: NAN_HAS_NAN}, inflight={})   # before the records are handled
    hold.emit(collective, nan=NAN_HAS_INF)   # held while a scaler's step is open
    hold.event("skipped")                    # the step's spans go out, marked skipped
"""

from __future__ import annotations

import collections
import json
from typing import Callable, Iterator

from commlens.exporters.telemetry import Collective, NonfiniteEntry
from commlens.ring.layout import LOSS_SCALE, NAN, NAN_HAS_INF, NAN_HAS_NAN, NAN_OUTPUT, START, Record
from commlens.ring.ops import OPS
from commlens.ring.reader import Folded

from .shapes import UNMARKED, Shapes
from .stats import Stats

_HELD = 4096
"""Collectives with non-finite tensors held in a loss scaler's step, at most (then exported as they end)."""


def kinds(flags: int) -> tuple[str, ...]:
    """What a NAN record's ``flags`` say its tensor held: "nan", "inf" or both."""
    return tuple(kind for bit, kind in ((NAN_HAS_NAN, "nan"), (NAN_HAS_INF, "inf")) if flags & bit)


def _entry_json(entry: NonfiniteEntry) -> str:
    """``entry``'s groups as its span carries them (``names.NONFINITE_ENTRY``)."""
    received: dict[str, dict[str, int]] = {}
    for (pg, peer), n in sorted(entry.received.items()):
        received.setdefault(pg, {})[str(peer)] = n
    return json.dumps({"issued": dict(sorted(entry.issued.items())), "received": received}, separators=(",", ":"))


class LossScaleHold:
    """A loss scaler's step in progress (hooks/loss_scale.py): ``step`` holds the spans of its
    collectives with non-finite tensors (None: no step open), until the scaler ends the step."""

    def __init__(self, stats: Stats, on_collective: Callable[[Collective], None]):
        self.stats, self.on_collective = stats, on_collective
        self.step: list[Collective] | None = None

    def emit(self, collective: Collective, nan: int) -> None:
        """A span to export; a non-finite one in a loss scaler's step waits for the step's outcome."""
        if nan and self.step is not None and len(self.step) < _HELD:
            self.step.append(collective)
        else:
            self.on_collective(collective)

    def event(self, name: str) -> None:
        """A loss scaler began a step ("made", or "scaled" a loss), or ended it, and the next begins: the
        non-finite values of a step it skipped were dropped with the step (its overflow, or values the
        scaler kept out of the weights), marked so on their spans. From step to step, not from the
        loss's scaling on: a pipeline stage before the last scales no loss of its own, and gets the Inf
        of the stage after it's overflow in its gradients."""
        if name in ("made", "scaled"):
            self.step = self.step or []  # a step already begun keeps what it holds
            return
        self.stats.loss_scale_step(name)
        self._release(self.stats.loss_scale_steps["skipped"] if name == "skipped" else 0)
        self.step = []

    def writer_ended(self) -> None:
        """The ring's writer will write no more: a step it never ended keeps its non-finite values as
        evidence of values entering."""
        if self.step is not None:
            self.stats.loss_scale_step(None)
            self._release(0)

    def _release(self, skipped_step: int) -> None:
        held, self.step = self.step or [], None
        for collective in held:
            self.on_collective(collective._replace(loss_scale_skipped=skipped_step))


class NonfiniteInputs:
    """Where the rank had come to in its groups when a collective's input held NaN or Inf, counted in
    ``Stats`` as the collective is issued (``issued``), and what its span carries of it (``marks_of``).
    ``p2p_issued``: (group, peer's global rank, "send" or "recv") -> point-to-point ops issued, kept by
    the sidecar as it reads them."""

    def __init__(self, stats: Stats, shapes: Shapes, hold: LossScaleHold):
        self.stats, self.shapes, self.hold = stats, shapes, hold
        self.p2p_issued: collections.Counter[tuple[str, int, str]] = collections.Counter()
        self.pending: dict[int, tuple[NonfiniteEntry, int]] = {}
        """op_id -> its input's ``NonfiniteEntry`` and a send's number, for the collectives of a read that
        holds a loss scaler's records whose inputs held NaN or Inf, until their START is handled."""
        self._marks: dict[int, tuple[int, str]] = {}
        """op_id -> (send number, entry as JSON) for the span of such a collective (``Collective``)."""

    def read(self, records: list[Record], folded: list[Folded], flags: dict[int, int],
             inflight: dict[int, Record]) -> None:
        """The collectives of this read whose inputs held NaN or Inf (``flags``: op id -> the NAN bits
        read before), each with where the rank had come to in its groups before it, counted in the order
        the rank issued them (op ids: a read hands its folded collectives over after the rest): while the
        rank's entry is not known, or for a send to a peer whose first such send is not. A read that holds
        a loss scaler's records folds none of them: they are counted as their STARTs are handled, in the
        scaler's step or not (``inflight``: the collectives issued before this read)."""
        stats, flags = self.stats, dict(flags)
        flags.update((r.op_id, r.flags) for r in records if r.kind == NAN and not r.flags & NAN_OUTPUT)
        if stats.nonfinite_entry is not None and not any(
                key not in stats.first_send for key in self._sends(records, folded, flags)):
            return
        starts = [(r.op_id, r, flags.get(r.op_id, 0)) for r in records if r.kind == START]
        starts += [(start.op_id, start, group.nan | flags.get(start.op_id, 0)) for group in folded
                   for start in (group.records(k)[0] for k in range(len(group.seqs())))]
        # a NAN record after its START, read before (a GPU's check): where the rank had come to when this
        # read began, which may count collectives issued after it
        starts += [(r.op_id, inflight[r.op_id], r.flags) for r in records
                   if r.kind == NAN and not r.flags & NAN_OUTPUT and r.op_id in inflight]
        issued = {pg: seq for (pg, state), seq in stats.last_seq.items() if state == "enqueued"}
        done = dict(self.p2p_issued)
        now = not any(r.kind == LOSS_SCALE for r in records)
        for op_id, start, nan in sorted(starts, key=lambda item: item[0]):
            shape = self.shapes.of(start)
            peer = self.shapes.global_rank(start.pg, start.peer) if shape.is_p2p else -1
            if nan:
                number = done.get((shape.pg, peer, "send"), 0) + 1 if shape.op == "send" else 0
                self.pending[op_id] = (NonfiniteEntry(
                    shape.pg, shape.op, start.seq, kinds(nan)[0], peer, dict(issued),
                    {(pg, other): n for (pg, other, op), n in done.items() if op == "recv"}), number)
                if now or op_id in inflight:
                    self.issued(op_id)
            if op_id in inflight:  # issued before this read: counted already
                continue
            if shape.is_p2p:
                done[(shape.pg, peer, shape.op)] = done.get((shape.pg, peer, shape.op), 0) + 1
            elif start.seq > issued.get(shape.pg, -1):
                issued[shape.pg] = start.seq

    def issued(self, op_id: int) -> None:
        """The collective ``op_id`` (``pending``) was issued: its non-finite input counted, in the loss
        scaler's step if one is in progress, and what its span carries of it."""
        entry, number = self.pending.pop(op_id)
        first = self.stats.nonfinite_input(entry, number, self.hold.step is not None)
        if first or number:
            self._marks[op_id] = (number, _entry_json(entry) if first else "")

    def marks_of(self, op_id: int) -> tuple[int, str]:
        """What the span of collective ``op_id`` carries of a non-finite input, taken."""
        return self._marks.pop(op_id, UNMARKED) if self._marks else UNMARKED

    def _sends(self, records: list[Record], folded: list[Folded], flags: dict[int, int]) -> Iterator[tuple]:
        """(group, peer, kind) of each send of this read whose input held NaN or Inf (``flags``: op id ->
        its NAN record's)."""
        shapes = self.shapes
        for record in records:
            if record.kind == START and flags.get(record.op_id) and OPS[record.op].value == "send":
                yield shapes.of(record).pg, shapes.global_rank(record.pg, record.peer), kinds(flags[record.op_id])[0]
        for group in folded:
            if group.nan and OPS[group.op].value == "send":
                yield shapes.of(group).pg, shapes.global_rank(group.pg, group.records(0)[0].peer), kinds(group.nan)[0]
