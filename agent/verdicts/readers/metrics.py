"""Ranks' facts from commlens' metrics, by name: one sample at a time (``metric_fact``), a rank settled
once read (``settle``). The endpoints' reader and Prometheus' read the same names."""

from __future__ import annotations

from commlens.exporters import names

from ..facts import RankFacts
from .common import lost


DURATION_SUM, DURATION_COUNT = f"{names.COLLECTIVE_DURATION}_sum", f"{names.COLLECTIVE_DURATION}_count"
SCALE_READ = (names.total(names.INPUT_SCALE_JUMPS), names.INPUT_SCALE_JUMP_SEQ, names.INPUT_SCALE_JUMP_STEP,
              names.INPUT_SCALE_JUMP_ORDERS, names.INPUT_SCALE_JUMP_TIME)
"""The metrics of a group's DDP buckets' scale, in ``GroupFacts.scale_read``'s order (the jumps: in all;
from Prometheus, only while the last is recent)."""
JUMPS_KEPT_S = 300
"""A jump of a bucket's scale is evidence this long (as ``CommlensInputDiverging`` holds); read from the
endpoints, by the rank's clock against the reader's."""


def metric_fact(facts: RankFacts, name: str, labels: dict, value: float) -> None:
    """What one sample of metric ``name`` (its ``labels``, its ``value``) tells of the rank."""
    pg = labels.get("pg")
    if name == names.LAST_SEQ and labels.get("state") == "enqueued":
        facts.group(pg).issued = int(value)
    elif name == names.LAST_SEQ and labels.get("state") == "completed":
        facts.group(pg).finished = int(value)
    elif name == names.HUNG_SEQ:
        facts.group(pg).hung = (labels["op"], int(value))
    elif name == names.HUNG_BYTES:
        facts.group(pg).hung_bytes = int(value)
    elif name == names.P2P_HUNG:
        facts.group(pg).p2p_hung = (labels["op"], int(labels["peer"]), value)
    elif name == names.FAILED_SEQ:
        facts.group(pg).failed = (labels["op"], int(value))
    elif name == names.P2P_FAILED:
        facts.group(pg).p2p_failed = (labels["op"], int(labels["peer"]), None)
    elif name == names.NONFINITE_FIRST_SEQ:
        group = facts.group(pg)
        if group.nonfinite is None or value < group.nonfinite[0]:
            group.nonfinite = (int(value), labels["op"], labels["kind"])
    elif name == names.NONFINITE_FIRST_SEND:
        sends = facts.group(pg).first_sends
        if value < sends.get(int(labels["peer"]), (value + 1,))[0]:  # its first of either kind
            sends[int(labels["peer"])] = (int(value), labels["kind"])
    elif name == names.NONFINITE_ENTRY_SEQ:
        facts.entry = (pg, labels["op"], int(value), labels["kind"], int(labels.get("peer") or -1))
    elif name == names.NONFINITE_ISSUED_BEFORE and labels.get("peer"):
        facts.received_before[(pg, int(labels["peer"]))] = int(value)
    elif name == names.NONFINITE_ISSUED_BEFORE:
        facts.issued_before[pg] = int(value)
    elif name in (names.REPLICA_FINGERPRINT, names.REPLICA_FINGERPRINT_SEQ):
        slot = facts.group(pg).fingerprint_slots.setdefault(labels["slot"], [None, None, None])
        if name == names.REPLICA_FINGERPRINT:
            slot[2] = int(value)
        else:
            slot[0], slot[1] = int(value), labels["op"]
    elif name in SCALE_READ:
        facts.group(pg).scale_read[SCALE_READ.index(name)] = value
    elif name == names.total(names.LOSS_SCALE_STEPS) and labels.get("outcome") == "skipped":
        facts.loss_scale_skipped = int(value)


def settle(facts: RankFacts, gone: bool, reasons: set[str], jumps_since: float | None = None) -> None:
    """Live: whether the rank is gone, how it ended (its snapshot ``reasons``), a group in which it
    issued collectives and completed none (no completed sequence number is exported before the first)
    has completed up to 0, and its buckets' last jump in scale if after ``jumps_since`` (unix seconds, the
    rank's clock; None: any jump the reader read)."""
    facts.gone, facts.lost, facts.stopped = gone, lost(reasons), "signal" in reasons
    for group in facts.groups.values():
        if group.finished is None and group.issued > 0:
            group.finished = 0
        group.fingerprints.update({seq: (op, value) for seq, op, value in group.fingerprint_slots.values()
                                   if value is not None and seq is not None})
        jumps, seq, step, orders, at = group.scale_read
        if jumps is not None:
            recent = jumps > 0 and None not in (seq, step, orders, at) and at > (jumps_since or 0)
            group.scale_jumps = {int(seq): (int(step), int(orders), at)} if recent else {}
