"""Replicas that disagree: after an all_reduce, a broadcast or an all_gather every member of the group
holds the same bytes; a member whose fingerprint of the result differs from the rest's, at the same
sequence number, holds a corrupted result (silent data corruption: a transfer, or the rank itself)."""

from __future__ import annotations

import collections

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
