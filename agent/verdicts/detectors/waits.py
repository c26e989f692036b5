"""How the detectors read waiting from ranks' facts: who waits in a group and on what, who is still in a
hang, time spent in collectives, and the cost a culprit's lateness puts on the job (the wait-for graph's
reading, shared by every family of detectors)."""

from __future__ import annotations

import collections
from typing import Any, Iterable

from ..facts import GroupFacts, RankFacts


def still_hung(g: GroupFacts) -> bool:
    """Its hang is not one it has since completed (``--prometheus`` reads hangs over the last minute: a
    rank that waited at start-up for the others, say)."""
    return g.hung is not None and (g.finished is None or g.finished < g.hung[1])


def waiting(facts: Iterable[RankFacts]) -> bool:
    """Whether any of these ranks waits past the hang threshold, or saw an op fail (a collective, or a
    point-to-point op on a peer), in any group."""
    return any(still_hung(g) or g.p2p_hung or g.failed or g.p2p_failed for f in facts for g in f.groups.values())


def waits(f: RankFacts) -> bool:
    """It waits itself: past the hang threshold in a collective or on a peer, or an op failed on it (or
    its abort snapshot says one did)."""
    return f.aborted or waiting([f])


def who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def member(f: RankFacts, pg: str) -> bool:
    """Whether rank ``f`` is taken for a member of group ``pg``: it was seen in it; the default group
    "0" is every rank's; a rank that vanished unseen in any group (killed before its first collective
    was scraped) may be in any."""
    return pg in f.groups or pg == "0" or (f.vanished and not f.groups)


def in_collectives(f: RankFacts, at_end: bool = False) -> float:
    """The share of its time the rank spends in its ops, all its groups together (live: now; after the
    fact: over the job, or with ``at_end`` over its last seconds, ``GroupFacts.waited_at_end_s``)."""
    return sum((g.waited_at_end_s if at_end else g.waited_s) or 0.0 for g in f.groups.values())


def waited_within(facts: RankFacts, since: int, until: int) -> bool:
    """Whether the rank waited long (in any group, on any peer) over most of ``since`` to ``until``
    (ns; from the same host's clock as its own waits, in a job of one node)."""
    return any(min(until, end if end is not None else until) - max(since, start) > (until - since) / 2
               for start, end in facts.waits.items())


def starting(f: RankFacts, at_ns: int) -> bool:
    """After the fact, whether rank ``f`` had begun no op before ``at_ns``: it was starting up
    (``RankFacts.started_ns``)."""
    return f.started_ns is not None and at_ns <= f.started_ns


def cost(caused_s: float, everyone: list[RankFacts]) -> str:
    """What the waits a culprit caused cost the job, after the fact: rank-seconds, and their share of
    the job's time (every rank's, from its first collective seen to its last)."""
    starts = [start for f in everyone for g in f.groups.values() for _, start in g.arrivals.values()]
    seconds = (max(starts) - min(starts)) / 1e9 if starts else 0.0
    share = f", {caused_s / (len(everyone) * seconds):.1%} of its time" if seconds > 0 else ""
    return f"the waits for it cost the job {caused_s:.1f} rank-seconds{share}"


def hang_threshold_s(pg: str, members: list[RankFacts]) -> float:
    """The group's hang threshold, as the earliest age at which a member reported a hang (0: none did)."""
    return min((f.groups[pg].threshold_s for f in members if pg in f.groups and f.groups[pg].threshold_s), default=0.0)


def ranks_by_seq(pg: str, members: list[RankFacts], field: str) -> dict[int, dict[int, Any]]:
    """seq -> rank -> its entry in the member's ``GroupFacts`` dict ``field`` (by seq) of group ``pg``."""
    by_seq: dict[int, dict[int, Any]] = collections.defaultdict(dict)
    for f in members:
        for seq, value in getattr(f.groups.get(pg, GroupFacts()), field).items():
            by_seq[seq][f.rank] = value
    return by_seq
