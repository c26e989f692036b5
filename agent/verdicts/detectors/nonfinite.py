"""NaN/Inf origin: where a non-finite value entered the job, by happens-before (a value that reached a
rank through a recv or a collective's output is propagation, not entry)."""

from __future__ import annotations

import collections

from ..facts import RankFacts, ranges
from ..finding import Finding


def nan_origins(facts: list[RankFacts]) -> list[Finding]:
    """Where NaN or Inf entered the job: the ranks whose first non-finite input (``entry``) no non-finite
    value had reached before — no collective they had issued in a group whose input held one on
    another rank at that sequence number or before (its output carries it), no recv they had issued
    from a peer that had sent one. The ranks it reached are named as propagation, not entry. One finding
    per entry (ranks whose inputs held it in the same collective share one). From telemetry without
    entries (an older commlens): by group, the lowest sequence number."""
    if not any(f.entry for f in facts):
        return _nan_origins_by_group(facts)
    by_rank = {f.rank: f for f in facts}
    how = {f.rank: why for f in facts if f.entry and (why := _reached(f, facts, by_rank))}
    origins: dict[tuple, list[int]] = collections.defaultdict(list)
    for f in facts:
        if f.entry and f.rank not in how:
            origins[f.entry[:3]].append(f.rank)
    if not origins:  # entries that reached each other (issued both ways round): no entry to tell
        return _nan_origins_by_group(facts)
    ways: dict[str, list[int]] = collections.defaultdict(list)  # ranks reached the same way, together
    for rank, why in sorted(how.items()):
        ways[why].append(rank)
    reached = "; it reached " + ", ".join(f"rank{'s' * (len(ranks) > 1)} {ranges(ranks)} ({why})"
                                          for why, ranks in ways.items()) if how else "; no other rank saw any"
    found = []
    for (pg, op, seq), ranks in sorted(origins.items(), key=lambda item: item[1]):
        kind, peer = by_rank[ranks[0]].entry[3:]
        where = f" to rank {peer}" if peer >= 0 else ""
        found.append(Finding("nan_origin", tuple(ranks), pg, op, seq,
                             f"its input{where} held {'NaN' if kind == 'nan' else 'Inf'} before any non-finite value "
                             f"reached it" + reached))
    return found


def _reached(f: RankFacts, facts: list[RankFacts], by_rank: dict[int, RankFacts]) -> str:
    """How a non-finite value had reached rank ``f`` before its entry: "" if none did."""
    for pg, seq in sorted(f.issued_before.items()):
        senders = sorted((g.nonfinite[0], other.rank) for other in facts if other is not f
                         and (g := other.groups.get(pg)) is not None and g.nonfinite and g.nonfinite[0] <= seq)
        if senders:
            return f"the output of group {pg}'s seq {senders[0][0]}, whose input held it on rank {senders[0][1]}"
    for (pg, peer), received in sorted(f.received_before.items()):
        sender = by_rank.get(peer)
        sent = sender.groups[pg].first_sends.get(f.rank) if sender is not None and pg in sender.groups else None
        if sent is not None and sent[0] <= received:
            return f"a recv from rank {peer} in group {pg}"
    return ""


def _nan_origins_by_group(facts: list[RankFacts]) -> list[Finding]:
    """Per group, the ranks whose input held NaN or Inf at its lowest sequence number."""
    return [found for pg in sorted({pg for f in facts for pg in f.groups})
            for found in _nan_origin(pg, [f for f in facts if pg in f.groups or pg == "0"])]


def _nan_origin(pg: str, members: list[RankFacts]) -> list[Finding]:
    seen = [(f.groups[pg].nonfinite, f.rank) for f in members if pg in f.groups and f.groups[pg].nonfinite]
    if not seen:
        return []
    first = min(seq for (seq, _, _), _ in seen)
    origin = sorted(rank for (seq, _, _), rank in seen if seq == first)
    (_, op, kind), _ = next(item for item in seen if item[0][0] == first)
    later = sorted(rank for (seq, _, _), rank in seen if seq > first)
    evidence = f"its input held {'NaN' if kind == 'nan' else 'Inf'} at seq {first}" + (
        f"; ranks {later} saw non-finite inputs only later" if later else "; no other rank saw any")
    return [Finding("nan_origin", tuple(origin), pg, op, first, evidence)]
