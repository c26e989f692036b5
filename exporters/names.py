"""The names others depend on: metric families and span attributes (docs/metrics.md, docs/traces.md).

The exporters write these names, ``commlens diagnose`` and the timeline read them, and the tests
check that the alert rules and dashboards query no other (``served()``). Change one on purpose,
here, and everywhere it is read at once.

Example::

    from commlens.exporters import names
    names.total(names.HANGS)            # "commlens_hangs_total": what Prometheus stores of the counter
    span_attributes[names.SEQ]          # "commlens.seq"
"""

from __future__ import annotations

# -- Prometheus metric families (every series also carries ``rank``; docs/metrics.md has each) --------

COLLECTIVE_DURATION = "commlens_collective_duration_seconds"
COLLECTIVES = "commlens_collectives"
COLLECTIVE_BYTES = "commlens_collective_bytes"
COLLECTIVE_BUS_BYTES = "commlens_collective_bus_bytes"
GPU_QUEUE = "commlens_collective_gpu_queue_seconds"
GPU_EXEC = "commlens_collective_gpu_exec_seconds"
LAST_SEQ = "commlens_collective_last_seq"
INFLIGHT = "commlens_collective_inflight"
INFLIGHT_OLDEST = "commlens_collective_inflight_oldest_seconds"
HUNG_SEQ = "commlens_collective_hung_seq"
HUNG_BYTES = "commlens_collective_hung_bytes"
P2P_HUNG = "commlens_p2p_hung_seconds"
FAILED_SEQ = "commlens_collective_failed_seq"
P2P_FAILED = "commlens_p2p_failed_seq"
HANGS = "commlens_hangs"
NAN_EVENTS = "commlens_nan_events"
NONFINITE_FIRST_SEQ = "commlens_nonfinite_first_seq"
NONFINITE_FIRST_SEND = "commlens_nonfinite_first_send"
NONFINITE_ENTRY_SEQ = "commlens_nonfinite_entry_seq"
NONFINITE_ISSUED_BEFORE = "commlens_nonfinite_issued_before_seq"
REPLICA_FINGERPRINT = "commlens_replica_fingerprint"
REPLICA_FINGERPRINT_SEQ = "commlens_replica_fingerprint_seq"
INPUT_SCALE_JUMPS = "commlens_input_scale_jumps"
INPUT_SCALE_JUMP_ORDERS = "commlens_input_scale_jump_orders"
INPUT_SCALE_JUMP_SEQ = "commlens_input_scale_jump_seq"
INPUT_SCALE_JUMP_STEP = "commlens_input_scale_jump_step"
INPUT_SCALE_JUMP_TIME = "commlens_input_scale_jump_time_seconds"
LOSS_SCALE_STEPS = "commlens_loss_scale_steps"
ABORT_SNAPSHOTS = "commlens_abort_snapshots"
RING_RECORDS_DROPPED = "commlens_ring_records_dropped"
SPANS_EXPORTED = "commlens_spans_exported"
TELEMETRY_ERRORS = "commlens_telemetry_errors"
INFO = "commlens_info"
RANK_UP = "commlens_rank_up"

HISTOGRAMS = (COLLECTIVE_DURATION,)
COUNTERS = (COLLECTIVES, COLLECTIVE_BYTES, COLLECTIVE_BUS_BYTES, GPU_QUEUE, GPU_EXEC, HANGS, NAN_EVENTS,
            LOSS_SCALE_STEPS, ABORT_SNAPSHOTS, RING_RECORDS_DROPPED, SPANS_EXPORTED, TELEMETRY_ERRORS,
            INPUT_SCALE_JUMPS)
GAUGES = (LAST_SEQ, INFLIGHT, INFLIGHT_OLDEST, HUNG_SEQ, HUNG_BYTES, P2P_HUNG, FAILED_SEQ, P2P_FAILED,
          NONFINITE_FIRST_SEQ, NONFINITE_FIRST_SEND, NONFINITE_ENTRY_SEQ, NONFINITE_ISSUED_BEFORE, REPLICA_FINGERPRINT,
          REPLICA_FINGERPRINT_SEQ, INPUT_SCALE_JUMP_ORDERS, INPUT_SCALE_JUMP_SEQ,
          INPUT_SCALE_JUMP_STEP, INPUT_SCALE_JUMP_TIME, INFO, RANK_UP)


def total(counter: str) -> str:
    """The series name Prometheus stores for ``counter``."""
    return f"{counter}_total"


def served() -> set[str]:
    """Every series name a commlens endpoint can serve: what a rule or a dashboard may query."""
    return ({f"{h}_{suffix}" for h in HISTOGRAMS for suffix in ("bucket", "sum", "count")}
            | {total(c) for c in COUNTERS} | set(GAUGES))


# -- span attributes ---------------------------------------------------------------------------------

JOB, WORLD_SIZE, RANK = "commlens.job", "commlens.world_size", "commlens.rank"
ATTEMPT = "commlens.attempt"
"""A resource attribute: the job's elastic restarts before this run of the rank (0: the first attempt)."""
OP, OP_ID, SEQ, P2P, ASYNC = "commlens.op", "commlens.op_id", "commlens.seq", "commlens.p2p", "commlens.async"
PG_NAME, PG_SIZE = "commlens.pg.name", "commlens.pg.size"
BYTES, DTYPE, BUSBW = "commlens.bytes", "commlens.dtype", "commlens.busbw_bytes_per_s"
STATUS, IN_FLIGHT, AGE_S = "commlens.status", "commlens.in_flight", "commlens.age_s"
NAN, INF, HANG, SLOW = "commlens.nan", "commlens.inf", "commlens.hang", "commlens.slow"
MODULE, PHASE = "commlens.module", "commlens.phase"
PEER = "commlens.peer"
"""A point-to-point op's peer, as a global rank."""
SEND_NUMBER = "commlens.p2p.send_number"
"""On the first send to its peer whose input held NaN or Inf: its number among the rank's sends to that
peer in the group (1: the first); the recvs the peer had issued before its own entry tell whether the
values reached it."""
NONFINITE_ENTRY = "commlens.nonfinite.entry"
"""On the rank's first input of all that held NaN or Inf: where it had come to in its groups then, JSON
``{"issued": {group: last collective seq}, "received": {group: {peer: recvs from it}}}``."""
FINGERPRINT = "commlens.fingerprint"
"""On a fingerprinted collective (every Nth all_reduce, broadcast, all_gather of its group): its result's
fingerprint, the same on every member unless one's result was corrupted."""
INPUT_SCALE_JUMP = "commlens.input_scale_jump"
"""On a DDP bucket whose largest value grew 2^n over the bucket's recent scale on this rank: n (a value
flipped high, or the rank's gradients grown; its peers' buckets tell which)."""
INPUT_SCALE_JUMP_AT_STEP = "commlens.input_scale_jump.step"
"""On such a bucket: its group's DDP step, counted from 0 (the same on every replica)."""
LOSS_SCALE_SKIPPED = "commlens.loss_scale.skipped_step"
"""On a collective with a non-finite tensor in a step the loss scaler skipped: that step's number among
the skipped steps of its rank (1, 2, ...). Its values were the scaler's overflow, not a fault."""
DDP_BUCKET, DDP_IS_LAST, DDP_WIRE_BYTES = "commlens.ddp.bucket", "commlens.ddp.is_last", "commlens.ddp.wire_bytes"
GPU_QUEUE_S, GPU_EXEC_S = "commlens.gpu.queue_s", "commlens.gpu.exec_s"
