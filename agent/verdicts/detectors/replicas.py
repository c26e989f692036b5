"""Replicas that disagree: after an all_reduce, a broadcast or an all_gather every member of the group
holds the same bytes; a member whose fingerprint of the result differs from the rest's, at the same
sequence number, holds a corrupted result (silent data corruption: a transfer, or the rank itself).
And replicas whose inputs diverge: data-parallel ranks' gradients differ by their data, not by orders of
magnitude; a member whose DDP bucket's largest value jumped where the rest's did not computed wrong, or
had a value flipped high."""

from __future__ import annotations

import collections

from commlens.exporters.telemetry import BURST_GAP_S

from ..facts import RankFacts
from ..finding import Finding
from .waits import who


def replica_mismatches(pg: str, members: list[RankFacts]) -> list[Finding]:
    """The group's first fingerprinted collective whose members' results differ: the ranks that hold the
    highest fingerprint of it, or the lowest, where at most half the members that fingerprinted it hold
    that one (two that differ: both; as ``commlens:replica_minority``: a corrupted rank holds a value of
    its own, the highest or the lowest). A collective is compared once every member of the group holds
    its fingerprint (two of three compared while the third is behind would both be named), and where they
    all name one op (ops that differ at one seq are a desync's, named elsewhere)."""
    holding = [f for f in members if pg in f.groups]
    by_seq: dict[int, dict[int, tuple[str, int]]] = collections.defaultdict(dict)
    for f in holding:
        for seq, (op, value) in f.groups[pg].fingerprints.items():
            by_seq[seq][f.rank] = (op, value)
    for seq in sorted(by_seq):
        results = by_seq[seq]
        ops = {op for op, _ in results.values()}
        if len(results) < len(holding) or len(ops) > 1:
            continue
        shares = collections.Counter(value for _, value in results.values())
        if len(shares) < 2:
            continue
        ends = (max(shares), min(shares))
        odd = sorted(rank for rank, (_, value) in results.items() if value in ends and 2 * shares[value] <= len(results))
        rest = sorted(set(results) - set(odd))
        evidence = (f"its result differs from {who(rest)}'s, who hold the same" if rest else
                    "their results differ from each other: which one is corrupted is not known")
        return [Finding("replica_mismatch", tuple(odd), pg, ops.pop(), seq, evidence)]
    return []


def diverging_inputs(pg: str, members: list[RankFacts]) -> list[Finding]:
    """The members whose DDP buckets' scale jumped first (``GroupFacts.scale_jumps``: 2^8 or more over the
    bucket's recent scale), where at most half of the members that follow their buckets' scale did in
    that step: their gradients grew while their replicas' did not. Jumps under ``BURST_GAP_S`` apart, of
    any member, are one event, and only its first step counts: a value flipped high reaches every replica
    through the all_reduce, whose next steps jump too (as NaN spreads from its origin). Where more jumped
    in it, it is the job's own (a loss spike, a loss scaler's growth), no rank's."""
    followed = [f for f in members if pg in f.groups and f.groups[pg].scale_jumps is not None]
    jumps = sorted((at, step, seq, f.rank, orders) for f in followed
                   for seq, (step, orders, at) in f.groups[pg].scale_jumps.items())
    events: list[list[tuple[float, int, int, int, int]]] = []
    for jump in jumps:
        if not events or jump[0] - events[-1][-1][0] >= BURST_GAP_S:
            events.append([])
        events[-1].append(jump)
    found: dict[int, Finding] = {}
    for event in events:
        first = min(step for _, step, *_ in event)
        origins: dict[int, tuple[int, int]] = {}  # rank -> (its first seq, orders) in the first step
        for _, step, seq, rank, orders in event:
            if step == first and seq < origins.get(rank, (seq + 1,))[0]:
                origins[rank] = (seq, orders)
        if 2 * len(origins) > len(followed):
            continue
        rest = sorted(f.rank for f in followed if f.rank not in origins)
        for rank, (seq, orders) in sorted(origins.items()):
            found.setdefault(rank, Finding(
                "diverging_input", (rank,), pg, "all_reduce", seq,
                f"its gradients' largest value grew 2^{orders} over the bucket's recent scale in step {first}, "
                f"{who(rest)}'s did not (later jumps of theirs follow from it)"))
    return list(found.values())
