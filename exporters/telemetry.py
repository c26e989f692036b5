"""What the sidecar hands the exporters: each collective (for spans), and a rank's telemetry as a
metrics collector reads it at each scrape (``RankTelemetry``). Plain types, no torch.

Example::

    class Source:                        # anything with RankTelemetry's methods
        def stats_snapshot(self) -> StatsSnapshot: ...
    MetricsCollector(Source(), DURATION_BUCKETS)
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Protocol

HAND_OVER_S = 20e-6
"""A sleep long enough for a thread waiting for the GIL (training) to wake and take it (``time.sleep(0)``
would take it straight back): the sidecar and the span processor sleep it between chunks of work."""


class Collective(NamedTuple):
    """One collective on this rank as the exporters see it; times are Unix ns."""

    op: str
    pg: str
    pg_size: int
    seq: int
    is_p2p: bool
    op_id: int
    rank: int
    nbytes: int
    dtype: str
    async_op: bool
    status: str
    start_ns: int
    end_ns: int
    busbw: float
    """Bytes per second, nccl-tests' bus bandwidth; 0 when unknown."""
    nan: bool
    """A tensor held NaN (``inf``: a tensor held Inf)."""
    hang: bool
    slow: bool
    in_flight: bool
    bucket: int = -1
    """The DDP gradient bucket's index, -1 for other collectives."""
    last_bucket: bool = False
    wire_bytes: int = 0
    """For a DDP bucket: bytes its hook's collectives carried, after compression."""
    module: str = ""
    """The module that issued it and the phase, when module attribution is on."""
    phase: str = ""
    inf: bool = False
    gpu_start_ns: int = -1
    """When it started on the GPU (Unix ns), for a collective on CUDA tensors; -1 otherwise:
    issue -> GPU start is its queueing time, GPU start -> end its execution time."""
    peer: int = -1
    """A point-to-point op's peer, as a global rank: the rank it waits on; -1 for a collective."""
    loss_scale_skipped: int = 0
    """For a collective with a non-finite tensor in a step that the loss scaler then skipped: that
    step's number among the steps it skipped on this rank (1, 2, ...); 0 otherwise."""
    send_number: int = 0
    """For the first send to its peer whose input held NaN or Inf: its number among this rank's sends
    to that peer in the group (1: the first); 0 otherwise."""
    nonfinite_entry: str = ""
    """For the rank's first input of all that held NaN or Inf: where it had come to in its groups then,
    as JSON (``{"issued": {group: seq}, "received": {group: {peer: recvs}}}``, ``NonfiniteEntry``)."""
    fingerprint: int = -1
    """For a fingerprinted collective (every member of its group holds the same result): its result's
    fingerprint (48 bits, ``hooks/fingerprints.py``); -1 otherwise."""
    scale_jump: tuple[int, int] | None = None
    """For a DDP bucket whose largest value grew ``2**orders`` over the bucket's recent scale
    (``agent/scales.py``): (orders, the DDP step of its group, counted from 0); None otherwise."""


class NonfiniteEntry(NamedTuple):
    """A rank's first input of all that held NaN or Inf (outside steps a loss scaler skipped), and how
    far it had come in its groups then: what could have brought the values to it. A value it had
    received — the output of a collective whose input held one on another rank, or a recv from a peer
    whose send held one — makes the entry propagation; none, and the values entered on this rank."""

    pg: str
    op: str
    seq: int
    """Its sequence number in its group (a point-to-point op's: c10d's number of it among the group's)."""
    kind: str
    """"nan" or "inf" (NaN where it held both)."""
    peer: int
    """A send's peer (global rank); -1 for a collective."""
    issued: dict[str, int]
    """group -> the last collective it had issued in that group before."""
    received: dict[tuple[str, int], int]
    """(group, peer's global rank) -> the recvs from that peer it had issued in that group before."""


class GroupInFlight(NamedTuple):
    """One group's in-flight collectives at a moment."""

    count: int
    oldest_s: float
    hung_op: str | None
    """The oldest collective (not point-to-point) in flight past the hang threshold: its op and seq."""
    hung_seq: int | None
    p2p_hung: tuple[str, int, float] | None = None
    """The oldest point-to-point op in flight past the hang threshold: its op, its peer's global rank
    (the rank it waits on) and its age in seconds."""
    hung_bytes: int | None = None
    """The payload bytes of the oldest collective in flight past the hang threshold (``hung_seq``'s)."""


BURST_GAP_S = 60.0
"""A rank's jumps of a DDP bucket's scale less than this apart are one burst, of its group's members' one
event: a value flipped high reaches every replica through the all_reduce, and their next steps' gradients
jump too; the first jump is where it began (``StatsSnapshot.scale_jumps``)."""


class StatsSnapshot(NamedTuple):
    """A rank's counters at one moment (``Stats.snapshot()``), keyed as the metrics are labelled."""

    durations: dict[tuple[str, str, str], tuple[list[int], list[tuple[int, float] | None], float]]
    """(op, pg, size class) -> (count per latency bucket, its latest (seq, seconds) or None, seconds in all)."""
    completed: dict[tuple[str, str, str], int]
    """(op, pg, status) -> completed collectives."""
    bytes: dict[tuple[str, str], float]
    bus_bytes: dict[tuple[str, str], float]
    last_seq: dict[tuple[str, str], int]
    """(pg, state "enqueued" or "completed") -> the last sequence number."""
    hangs: dict[tuple[str, str], int]
    nans: dict[tuple[str, str, str], int]
    """(op, pg, kind "nan" or "inf") -> collectives with a non-finite tensor."""
    snapshots: dict[str, int]
    first_nonfinite: dict[tuple[str, str], tuple[int, str]]
    """(pg, kind) -> (seq, op): the first collective whose input held NaN or Inf."""
    failed: dict[str, tuple[int, str]]
    """pg -> (seq, op): the first collective that failed (error or timeout)."""
    gpu_queue: dict[tuple[str, str], float]
    gpu_exec: dict[tuple[str, str], float]
    """(op, pg) -> seconds collectives on CUDA tensors waited for the GPU (``gpu_queue``) / ran on it."""
    loss_scale_steps: dict[str, int]
    """outcome ("applied" or "skipped") -> steps a loss scaler ended so."""
    first_send: dict[tuple[str, int, str], int]
    """(pg, peer's global rank, kind) -> the number, among the sends to that peer in that group (1: the
    first), of the first whose input held NaN or Inf."""
    nonfinite_entry: NonfiniteEntry | None
    p2p_failed: dict[str, tuple[int, str, int]]
    """pg -> (seq, op, the peer's global rank): the first point-to-point op that failed (its peer's process
    ended: gloo fails at once)."""
    fingerprints: dict[tuple[str, str], tuple[int, int, str]]
    """(pg, slot) -> (seq, fingerprint, op): the group's last fingerprinted results, ``FINGERPRINT_SLOTS`` of
    them, each in the slot of its number among them (the same slot on every rank for the same seq)."""
    scale_jumps: dict[str, tuple[int, int, int, int, float]]
    """pg -> (jumps, seq, step, binary orders, wall time) of the group's DDP buckets whose scale this rank
    follows: how many grew ``2**SCALE_JUMP`` or more over their recent scale; the first jump of the latest
    burst (its seq, DDP step and orders: where it began) and the time of its last (zeros: none yet)."""


class RankTelemetry(Protocol):
    """One rank's telemetry, read at each scrape (``agent.pipeline.RankPipeline``)."""

    def stats_snapshot(self) -> StatsSnapshot: ...

    def inflight_by_group(self) -> Mapping[str, GroupInFlight]: ...

    def dropped(self) -> int:
        """Ring records overwritten before they were read."""

    def span_results(self) -> Mapping[str, int]:
        """Spans by result (``SPAN_RESULTS``)."""

    def telemetry_errors(self) -> Mapping[str, int]:
        """Telemetry the writer lost, by ``ERRORS`` kind."""

    def info(self) -> Mapping[str, Any]:
        """``commlens_info``'s labels: rank, local_rank, world_size, job, backend, version."""
