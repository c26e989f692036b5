"""Ranks that ended: killed, crashed or vanished (their dumps, notes and spans say how), and nodes that
could not be reached."""

from __future__ import annotations

import collections

from ..facts import GroupFacts, RankFacts
from ..finding import Finding
from .waits import member, still_hung, waits, who


def lost_unseen(facts: list[RankFacts], found: list[Finding]) -> list[Finding]:
    """A killed rank that no other finding names, because no rank was seen waiting on it (live: the job
    torn down within a scrape; after the fact: its peers completed the collective it died in): named in
    the collective it had in flight, whose op its dump holds and the metrics do not; one that vanished,
    in the collective its peers were still in (``died_in``)."""
    named = {rank for f in found if f.kind == "lost_rank" for rank in f.ranks}
    unseen = []
    for f in facts:
        if f.lost and f.rank not in named and (in_flight := died_in(f, facts) if f.vanished else groups_in_flight(f)):
            pg = min(in_flight, key=lambda group: (len(group), group))
            group = f.groups.get(pg)
            theirs = [_last_issued(other.groups[pg]) for other in facts if other is not f and pg in groups_in_flight(other)]
            if f.vanished and theirs:  # the collective its peers were in: it died in it, or before it
                seq, op = max(theirs)
                unseen.append(Finding("lost_rank", (f.rank,), pg, op, seq, f"{death(f)}; the others were still in "
                                      "it when the job was torn down"))
            elif group is None:  # never seen in it: killed before its metrics were first scraped
                unseen.append(Finding("lost_rank", (f.rank,), pg, "a collective", None, f"{death(f)}, and the job "
                                      "was torn down: the others were told to stop"))
            elif not group.issued and not group.inputs:  # a group of point-to-point ops alone
                unseen.append(Finding("lost_rank", (f.rank,), pg, "a point-to-point op", None,
                                      f"{death(f)}: its peers' ops with it failed or waited"))
            else:
                seq, op = _last_issued(group)
                unseen.append(Finding("lost_rank", (f.rank,), pg, op, seq, f"{death(f)} inside it"))
    return unseen


def _last_issued(group: GroupFacts) -> tuple[int, str]:
    """The sequence number and op of the last collective a rank issued in a group ("a collective" where
    its input was not seen)."""
    return group.issued, group.inputs.get(group.issued, ("a collective",))[0]


def death(f: RankFacts) -> str:
    """How a lost rank's process is known to have ended without a signal or an exception."""
    if f.vanished and f.unreachable:
        return "its metrics endpoint went down with no word of how its process ended (SIGKILL, the OOM killer, a crash)"
    if f.vanished:
        return "its process left no dump and no note that it ended, where the others left theirs (SIGKILL, " \
            "the OOM killer, a crash)"
    return "its process ended without a signal or an exception (SIGKILL, the OOM killer, a crash)"


def died_in(f: RankFacts, facts: list[RankFacts]) -> set[str]:
    """The groups of a rank that ``vanished`` in which it died: where another rank failed, or waits (live)
    or was still waiting (after the fact) in a collective or on it (``member``). None: it vanished while
    the others carried on unharmed, and is not known to have died. (Its own last scrape, or its spans,
    may end before the collective it died in.) Collectives first: where only point-to-point ops on it
    failed or waited, the collectives that ranks told to stop were still in (torchrun stops every rank
    once one has died). Where the job was torn down before any rank was seen waiting (live, or in the
    dumps of ranks signalled within milliseconds of the death): those groups, or else the default group
    "0" — the others said how they ended, it did not."""
    others = [other for other in facts if other.rank != f.rank]
    in_collectives = {pg for other in others for pg, g in other.groups.items() if member(f, pg) and (
        g.failed or still_hung(g) or any(end is None for _, end in g.hangs_seen.values()))}
    on_it = {pg for other in others for pg, g in other.groups.items() if member(f, pg) and (
        (g.p2p_hung or ("", -1))[1] == f.rank or (g.p2p_failed or ("", -1))[1] == f.rank
        or any(end is None and peer == f.rank for _, end, _, peer in g.p2p_waits_seen))}
    told = {pg for other in others if _told_to_stop(other) for pg in groups_in_flight(other) if member(f, pg)}
    if in_collectives or on_it:
        return in_collectives or told or on_it
    return (told or {"0"}) if any(_told_to_stop(other) for other in others) else set()


def _told_to_stop(f: RankFacts) -> bool:
    """Whether rank ``f`` ended told to stop (SIGTERM: torchrun tears a job down once a rank has died):
    live, its last scrapes said so and it is gone; after the fact, its dumps say when it was signalled."""
    return (f.stopped and f.gone) or f.signalled_ns is not None


def groups_in_flight(f: RankFacts) -> set[str]:
    """The groups in which rank ``f`` had a collective issued and not completed (live, or the dump of a rank
    killed or told to stop)."""
    return {pg for pg, g in f.groups.items() if g.finished is not None and g.issued > g.finished}


def unreachable_nodes(facts: list[RankFacts]) -> list[Finding]:
    """Live: a node none of whose ranks Prometheus reaches any more while ranks of other nodes wait
    (past the hang threshold, or an op failed on them): killed with its ranks, or cut off. Not a node
    whose own ranks were seen waiting or told to stop: a job torn down ends every node."""
    nodes: dict[str, list[RankFacts]] = collections.defaultdict(list)
    for f in facts:
        if f.node:
            nodes[f.node].append(f)
    found = []
    for node, ranks in sorted(nodes.items()):
        if not all(f.unreachable for f in ranks) or any(waits(f) or f.stopped for f in ranks):
            continue
        waiting = [f for f in facts if f.node != node and waits(f)]
        if not waiting:
            continue
        pg, op, seq = next(((pg, *(g.hung if still_hung(g) else g.failed)) for f in waiting
                            for pg, g in sorted(f.groups.items()) if still_hung(g) or g.failed), ("", "", None))
        found.append(Finding("node_unreachable", tuple(f.rank for f in ranks), pg, op, seq,
                             f"Prometheus reaches none of its metrics endpoints, and {who([f.rank for f in waiting])} "
                             "of other nodes wait past the hang threshold or saw their ops fail: its link or the host "
                             "is down", node=node))
    return found
