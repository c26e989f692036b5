"""What a ring's records mean: each (op, group, payload, signature) decoded once into a ``Shape``, the
groups' names and members, and the ``Collective`` a span is built from a collective's records.

Example::

    shapes = Shapes(ring, rank=0, detail="full")
    shape = shapes.known.get((start.op, start.pg, start.nbytes, start.sig)) or shapes.of(start)
    collective = shapes.collective(shape, start, end, "ok", nan=0, hang=False, slow=False)
"""

from __future__ import annotations

from typing import NamedTuple

from commlens.exporters.telemetry import Collective
from commlens.ring.codec import decode_group, decode_signature
from commlens.ring.layout import FLAG_ASYNC, FLAG_LAST_BUCKET, NAN_HAS_INF, NAN_HAS_NAN, PHASES, START, Record, bucket_of
from commlens.ring.memory import Ring
from commlens.ring.ops import OPS

from .stats import ALL, bus_factor, size_class

_SHAPES = 4096
"""Shapes kept before the cache starts over (variable-size payloads would otherwise grow it)."""
UNMARKED = (0, "")
"""A span's (send number, entry) where its collective is neither (``Collective``)."""
_make = tuple.__new__


class Shape(NamedTuple):
    """What records of one (op, group, payload, signature) mean, worked out once."""

    op: str
    is_p2p: bool
    pg: str
    pg_size: int
    nbytes: int
    bus_bytes: float
    dtype: str
    counter_key: tuple[str, str]
    duration_key: tuple[str, str, str]
    ok_key: tuple[str, str, str]
    """``counter_key`` + "ok": the completed counter's key for the common status, built once."""
    enqueued_key: tuple[str, str]
    completed_key: tuple[str, str]
    typical_key: tuple[str, str, str]
    """(op, pg, size class) whatever the detail level: what a slow outlier is judged against."""


class Shapes:
    """The shapes and groups of one ring's records, decoded as first met. ``known``: the shapes so far,
    by (op, pg, nbytes, sig), for a caller's own lookup before ``of``; ``backend``: the backend of the
    first group described (the default group's, as a rule)."""

    def __init__(self, ring: Ring, rank: int, detail: str = "full"):
        self.ring, self.rank, self.detail = ring, rank, detail
        self.known: dict[tuple, Shape] = {}
        self.groups: dict[int, tuple[str, int]] = {}
        """A group's string id -> (its name, its size)."""
        self._members: dict[int, list[int]] = {}
        """A group's string id -> its global ranks, by group rank."""
        self.backend = ""

    def of(self, record: Record) -> Shape:
        key = (record.op, record.pg, record.nbytes, record.sig)
        found = self.known.get(key)
        if found is None:
            if len(self.known) >= _SHAPES:
                self.known.clear()
            op, (pg, size) = OPS[record.op], self.group(record.pg)
            label = op.value if self.detail != "group" else ALL  # the op label at this detail level
            sized = size_class(record.nbytes) if self.detail == "full" else ALL
            dtype = decode_signature(self.ring.string(record.sig)).dtype
            found = self.known[key] = Shape(op.value, op.is_p2p, pg, size, record.nbytes,
                                            record.nbytes * bus_factor(op.value, size), dtype, (label, pg),
                                            (label, pg, sized), (label, pg, "ok"), (pg, "enqueued"), (pg, "completed"),
                                            (op.value, pg, size_class(record.nbytes)))
        return found

    def group(self, sid: int) -> tuple[str, int]:
        """The name and size of the group whose description is the ring's string ``sid``."""
        found = self.groups.get(sid)
        if found is None:
            described = decode_group(self.ring.string(sid))
            if described is None:
                found = (str(sid), 1)
            else:
                found = (described.name, len(described.ranks))
                self._members[sid] = described.ranks
                self.backend = self.backend or described.backend
            self.groups[sid] = found
        return found

    def global_rank(self, sid: int, group_rank: int) -> int:
        """The global rank of ``group_rank`` in the group ``sid`` (itself where the group is not known)."""
        members = self._members.get(sid, [])
        return members[group_rank] if 0 <= group_rank < len(members) else group_rank

    def collective(self, shape: Shape, start: Record, end: Record | None, status: str, nan: int, hang: bool,
                   slow: bool, now_ns: int | None = None, gpu_start: int | None = None,
                   marks: tuple[int, str] = UNMARKED, fingerprint: int = -1,
                   scale_jump: tuple[int, int] | None = None) -> Collective:
        """What exporters see of a collective: ``nan``, the NAN_HAS_* bits seen for it; ``end`` None while
        it is in flight (at ``now_ns``); ``marks``, its span's (send number, entry); ``fingerprint``, its
        result's (-1: none); ``scale_jump``, its DDP bucket's (orders, step)."""
        offset = self.ring.clock_offset_ns
        flags, aux = (start.flags, start.aux) if start.kind == START else (0, 0)  # START lost: END alone
        end_ns = end.t_ns if end is not None else now_ns
        seconds = (end_ns - start.t_ns) / 1e9
        busbw = shape.bus_bytes / seconds if seconds > 0 and end is not None else 0.0
        return _make(Collective, (  # every field, in order: without NamedTuple's slower __new__
            shape.op, shape.pg, shape.pg_size, start.seq, shape.is_p2p, start.op_id, self.rank, shape.nbytes,
            shape.dtype, bool(flags & FLAG_ASYNC), status, start.t_ns + offset, end_ns + offset, busbw, bool(nan & NAN_HAS_NAN), hang,
            slow, end is None, bucket_of(aux), bool(flags & FLAG_LAST_BUCKET), end.aux if end is not None and aux else 0,
            self.ring.string(start.module) if start.module else "",
            PHASES[start.phase] if start.phase < len(PHASES) else "", bool(nan & NAN_HAS_INF),
            -1 if gpu_start is None else gpu_start + offset, self.global_rank(start.pg, start.peer) if shape.is_p2p else -1,
            0, *marks, fingerprint, scale_jump))
