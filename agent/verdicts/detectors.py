"""The detectors: ``findings()`` turns ranks' facts into verdicts of the catalogue's kinds, the same way
whatever the source (docs/verdicts.md says what each detector finds and why).

Example::

    for finding in findings(readers.from_files("./commlens-out/job-7")):
        print(finding.line())
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Any, Iterable

from .facts import GroupFacts, RankFacts, ranges
from .catalogue import KINDS
from .finding import Finding

STRAGGLER_MIN_S = 0.005
"""A straggler arrives at least this much later, on average, than the group's first rank ..."""
STRAGGLER_RATIO = 0.6
"""... and spends less than this fraction of the time in its ops that the member that spends most does ..."""
STRAGGLER_GAP = 0.25
"""... or, where that member spends over 5/8 of its time in its ops (a pipeline's bubble: its first stage
waits for its gradients however slow it is), this much less of the wall clock (``_waits_less``)."""
STRAGGLER_EVIDENCE = 30
"""After the fact, a straggler is only named from at least this many collectives seen by every rank."""
STRAGGLER_LIVE_EVIDENCE = 10
"""Live, from at least this many collectives of each rank in the window (docs/verdicts.md says why)."""
STALL_MIN_S = 1.0
"""After the fact, a one-off stall is named where the ranks held up by it waited this long (under the
hang threshold)."""
NODE_SLOW_MARGIN = 0.02
"""A slow node's ranks spend less of their time in collectives than any other node's by more than this."""
STRAGGLER_LEAD = 1.5
"""... or, after the fact, arrives later on average than this many times the next latest rank."""


def findings(facts: Iterable[RankFacts]) -> list[Finding]:
    """Every verdict the facts support, most severe first; [] for a healthy job. The waits form a
    graph: culprits are the ends of its chains, links are evidence, a round is a deadlock
    (docs/verdicts.md)."""
    facts = list(facts)
    facts = [dataclasses.replace(f, lost=True) if f.vanished and _died_in(f, facts) else f for f in facts]
    found: list[Finding] = []
    links: list[Finding] = []
    found += _nan_origins(facts)
    for pg in sorted({pg for f in facts for pg in f.groups}):
        members = [f for f in facts if _member(f, pg)]
        stuck = _hang(pg, members, facts)
        links += [f for f in stuck if f.kind == "deadlock"]
        stuck = [f for f in stuck if f.kind != "deadlock"]
        if not any(f.kind == "desync" for f in stuck):
            stuck += _mismatch(pg, members)
        mismatched = _size_mismatch(pg, members)
        if mismatched:  # the backend fails or aborts the ranks in it: their hang or death there follows from it
            stuck = [f for f in stuck if f.kind == "desync" or (f.seq or 0) < mismatched[0].seq] + mismatched
        found += stuck
        if not stuck and not any(f.pg == pg for f in links) and not any(f.lost for f in members):
            found += _straggler(pg, members, facts) + _stalls(pg, members, facts) + _peer_stalls(pg, members, facts)
    found = _once_each(_held_by_stragglers(found, facts) + _lost_unseen(facts, found))
    lost = {rank for f in found if f.kind == "lost_rank" for rank in f.ranks}
    # a killed rank that a pipeline peer waits on is named once, as killed
    found += [f for f in _late_peers(facts) if not set(f.ranks) <= lost]
    unreachable = _unreachable_nodes(facts)
    if unreachable:  # the node is the fault: the ranks behind it, or waiting on it unseen, are not
        theirs = {rank for f in unreachable for rank in f.ranks}
        found = unreachable + [f for f in found if f.kind not in ("late_rank", "hang")
                               and not (f.kind in ("lost_rank", "straggler") and set(f.ranks) <= theirs)]
        links = []
    if links and not any(f.kind in ("lost_rank", "desync", "size_mismatch", "late_rank") for f in found):
        found.append(Finding("deadlock", tuple(sorted({r for f in links for r in f.ranks})), links[0].pg,
                             links[0].op, links[0].seq, "; ".join(f.evidence for f in links)))
    else:  # each culprit's finding shows who else its lateness holds up, through the ranks waiting on it
        found = [dataclasses.replace(f, evidence="; ".join([f.evidence, *(
            f"held up through them: {link.evidence}" for link in links if f.pg in link.waits_in)]))
            if f.kind == "late_rank" else f for f in found]
    # a slow node: named from its ranks' findings, or, when nothing worse is found, from their arrivals
    found = _slow_node(found, facts) if any(f.kind != "straggler" for f in found) else _node_last(found, facts)
    if not found:
        found = _network_slow(facts)
    order = [kind.name for kind in KINDS]
    return sorted(found, key=lambda f: order.index(f.kind))


def _nan_origins(facts: list[RankFacts]) -> list[Finding]:
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


def _hang(pg: str, members: list[RankFacts], everyone: list[RankFacts]) -> list[Finding]:
    """Late, missing and desynced ranks around the collective others hang in; a "deadlock" link when
    every rank behind waits itself in another group (``findings`` follows the chain)."""
    stop = _waits_of_the_stop(pg, members)
    live = {f.rank: state for f in members if pg in f.groups and (state := next(
        (s for s in (f.groups[pg].hung if _still_hung(f.groups[pg]) else None, f.groups[pg].failed)
         if s is not None and s[1] not in stop), None))}
    # live: a killed rank is named in the collective it died in, the one it had in flight; the waits in
    # another group (one that resolved, say) are not its death's, nor is a wait it has since come out of
    # (at start-up, for a rank still building its model) a hang
    lost = sorted(f.rank for f in members if f.lost and pg in (_died_in(f, everyone) if f.vanished else _in_flight(f)
                                                                 or {pg}))
    if not lost and any(f.lost for f in members):
        return []
    if live:
        seq = collections.Counter(s for _, s in live.values()).most_common(1)[0][0]
        ops = {rank: op for rank, (op, s) in live.items() if s == seq}
    else:  # after the fact: a hang that resolved, known from the spans of the ranks that waited
        waited = {s for f in members if pg in f.groups for s in f.groups[pg].hangs_seen} - stop
        if not waited:
            return []
        seq = min(waited)  # the first: later waits follow from it (a broadcast's root waits on a late receiver,
        # then the others wait on both in the next collective)
        ops = {f.rank: f.groups[pg].arrivals[seq][0] for f in members
               if pg in f.groups and seq in f.groups[pg].hangs_seen and seq in f.groups[pg].arrivals}
        if not ops:
            return []
    majority, count = collections.Counter(ops.values()).most_common(1)[0]
    waiting = sorted(rank for rank, op in ops.items() if op == majority)
    if lost:
        others = [rank for rank in sorted(ops) if rank not in lost]
        dead = next(f for f in members if f.rank == lost[0])
        own = dead.groups.get(pg)
        # the collective it died in: its last in its dump (others may have finished it); its spans end
        # before it, and its peers fail or wait in it
        if own is not None and 0 < own.issued <= seq and not dead.vanished:
            majority = own.hung[0] if own.hung and own.hung[1] == own.issued else majority
            seq = own.issued
        return [Finding("lost_rank", tuple(lost), pg, majority, seq,
                        f"{_death(dead)}" + (f"; ranks {others} waited in or failed in seq {seq}" if others else ""))]
    found = []
    wrong = sorted(rank for rank, op in ops.items() if op != majority)
    if wrong and count > len(wrong):
        found.append(_desync(pg, seq, {r: ops[r] for r in wrong}, waiting, majority))
    starts = [f.groups[pg].arrivals[seq][1] for f in members if f.rank in waiting and seq in f.groups[pg].arrivals]
    first_wait, threshold_s = min(starts, default=None), _threshold_s(pg, members)
    late = {f.rank: why for f in members if f.rank not in ops
            and (why := _late(f, pg, seq, bool(live), first_wait, threshold_s)) is not None}
    elsewhere = {rank: where for rank in late if (where := _waiting_elsewhere(
        next(f for f in everyone if f.rank == rank), pg, bool(live), first_wait)) is not None}
    waits_in = tuple(sorted({group for group, _ in elsewhere.values()}))
    elsewhere = {rank: why for rank, (_, why) in elsewhere.items()}
    elsewhere.update(_waiting_earlier(pg, members, late, seq))
    how = "failed in" if live and all(not f.groups[pg].hung for f in members if f.rank in ops) else \
        "waited past the hang threshold in"
    waits = f"ranks {waiting} {how} {majority} (group {pg}) seq {seq}"
    if elsewhere and len(elsewhere) == len(late) and waits_in:  # held up by another group: its finding names the culprit
        return found + [Finding("deadlock", tuple(sorted(elsewhere)), pg, majority, seq, "; ".join(
            [waits, *(f"rank {rank} {where}" for rank, where in sorted(elsewhere.items()))]), waits_in)]
    if late:
        culprits = {rank: why for rank, why in late.items() if rank not in elsewhere}
        evidence = "; ".join([waits, *(f"rank {rank} {why}" for rank, why in sorted(culprits.items())),
                              *(f"rank {rank} is behind too, but {where}" for rank, where in sorted(elsewhere.items()))])
        found.append(Finding("late_rank", tuple(sorted(culprits)), pg, majority, seq, evidence))
    if not found and live:
        unmatched = _unmatched(pg, members, seq, ops, waiting, how, majority) or _unlike(pg, members, seq, waiting, majority)
        if unmatched:
            return [unmatched]
        if any(f.vanished and f.lost for f in everyone):  # gone without a word, maybe before it was seen in pg
            return []
        found.append(Finding("hang", tuple(waiting), pg, majority, seq,
                             f"ranks {waiting} wait in seq {seq} and no rank is behind: look at the network "
                             "or the backend"))
    return found


def _unreachable_nodes(facts: list[RankFacts]) -> list[Finding]:
    """Live: a node none of whose ranks Prometheus reaches any more while ranks of other nodes wait
    (past the hang threshold, or an op failed on them): killed with its ranks, or cut off. Not a node
    whose own ranks were seen waiting or told to stop: a job torn down ends every node."""
    nodes: dict[str, list[RankFacts]] = collections.defaultdict(list)
    for f in facts:
        if f.node:
            nodes[f.node].append(f)
    found = []
    for node, ranks in sorted(nodes.items()):
        if not all(f.unreachable for f in ranks) or any(_waits(f) or f.stopped for f in ranks):
            continue
        waiting = [f for f in facts if f.node != node and _waits(f)]
        if not waiting:
            continue
        pg, op, seq = next(((pg, *(g.hung if _still_hung(g) else g.failed)) for f in waiting
                            for pg, g in sorted(f.groups.items()) if _still_hung(g) or g.failed), ("", "", None))
        found.append(Finding("node_unreachable", tuple(f.rank for f in ranks), pg, op, seq,
                             f"Prometheus reaches none of its metrics endpoints, and {_who([f.rank for f in waiting])} "
                             "of other nodes wait past the hang threshold or saw their ops fail: its link or the host "
                             "is down", node=node))
    return found


def _slow_node(found: list[Finding], facts: list[RankFacts]) -> list[Finding]:
    """When the ranks found late, straggling or stalled are every rank of one node (two or more) and
    nobody else is blamed, the node is named instead, alive but slow: its endpoints answer (an
    unreachable node is ``_unreachable_nodes``')."""
    blamed = [f for f in found if f.kind in ("late_rank", "straggler", "stall")]
    if not blamed or any(f.kind not in ("late_rank", "straggler", "stall", "hang") for f in found):
        return found
    ranks = {rank for f in blamed for rank in f.ranks}
    if any(f.gone or f.unreachable for f in facts if f.rank in ranks):
        return found  # late because it stopped reporting: not known to be alive
    nodes = {f.node for f in facts if f.rank in ranks}
    node = nodes.pop() if len(nodes) == 1 else ""
    members = sorted(f.rank for f in facts if node and f.node == node)
    if len(members) < 2 or set(members) != ranks or len({f.node for f in facts}) < 2:
        return found
    how = "; ".join(f"{_who(list(f.ranks))} {f.kind.replace('_rank', '')} in group {f.pg}" for f in blamed)
    return [Finding("node_slow", tuple(members), blamed[0].pg, blamed[0].op, blamed[0].seq,
                    f"every rank of the node, and only they, are what the others wait for ({how}), and its "
                    "endpoints answer: the host is alive but slow (its CPU throttled or shared, memory, a stall)",
                    node=node)] + [f for f in found if f not in blamed]


def _waits(f: RankFacts) -> bool:
    """It waits itself: past the hang threshold in a collective or on a peer, or an op failed on it (or
    its abort snapshot says one did)."""
    return f.aborted or _waiting([f])


def _still_hung(g: GroupFacts) -> bool:
    """Its hang is not one it has since completed (``--prometheus`` reads hangs over the last minute: a
    rank that waited at start-up for the others, say)."""
    return g.hung is not None and (g.finished is None or g.finished < g.hung[1])


def _unmatched(pg: str, members: list[RankFacts], seq: int, ops: dict[int, str], waiting: list[int], how: str,
               op: str) -> Finding | None:
    """Live: ranks that wait in (or failed in) a collective every other member of the group completed.
    Their side of it did not match the others' — gloo waits for the bytes a larger input expects — or
    their own link failed: a size mismatch as the metrics show it (the dumps show the inputs)."""
    others = [f for f in members if f.rank not in ops]
    if not others or any(pg not in f.groups or (f.groups[pg].finished or 0) < seq for f in others):
        return None
    if not all(_still_hung(f.groups[pg]) for f in members if f.rank in waiting):
        return None  # a wait it has since come out of, or a failure (kept for minutes, past a restart)
    return Finding("size_mismatch", tuple(waiting), pg, op, seq,
                   f"ranks {[f.rank for f in others]} completed it and {_who(waiting)} {how} it: its side did not "
                   "match theirs (an input of another size or dtype; the dumps show each rank's), or its link failed")


def _unlike(pg: str, members: list[RankFacts], seq: int, waiting: list[int], op: str) -> Finding | None:
    """Live: ranks waiting in a collective whose ranks give alike (``SAME_INPUTS``) with payloads of other
    bytes than most of its waiters': their inputs did not match (gloo waits for the bytes a larger input
    expects: every rank of the group may hang)."""
    given = {f.rank: f.groups[pg].hung_bytes for f in members if f.rank in waiting and f.groups[pg].hung_bytes}
    if op not in SAME_INPUTS or len(set(given.values())) < 2:
        return None
    most, count = collections.Counter(given.values()).most_common(1)[0]
    wrong = sorted(rank for rank, n in given.items() if n != most)
    if count <= len(wrong):
        return None
    theirs = sorted(rank for rank in given if rank not in wrong)
    return Finding("size_mismatch", tuple(wrong), pg, op, seq,
                   f"its input was {' / '.join(f'{n} bytes' for n in sorted({given[r] for r in wrong}))} where ranks "
                   f"{theirs} gave {most} bytes, and they wait in it: their sides did not match")


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _waits_of_the_stop(pg: str, members: list[RankFacts]) -> set[int]:
    """The seqs whose waits were the job being stopped, not a fault: every rank behind was signalled
    (SIGTERM) before the first rank waiting had waited the hang threshold, or, for a collective that
    failed, at all (docs/running.md, "Snapshots on the way down"). Live, a collective that failed where
    every rank behind was told to stop (its snapshot says "signal"): gloo fails at once on a peer whose
    process ended, and a job torn down ends its ranks so."""
    def behind(seq: int) -> list[RankFacts]:
        return [f for f in members if pg not in f.groups or f.groups[pg].issued < seq]

    failed = {f.groups[pg].failed[1] for f in members if pg in f.groups and f.groups[pg].failed}
    stop = {seq for seq in failed if behind(seq) and all(f.stopped for f in behind(seq))}
    if not any(f.signalled_ns for f in members):
        return stop
    threshold_ns = _threshold_s(pg, members) * 1e9
    waited = {s for f in members if pg in f.groups for s in f.groups[pg].hangs_seen}
    for seq in waited | failed:
        starts = [f.groups[pg].arrivals[seq][1] for f in members if pg in f.groups and seq in f.groups[pg].arrivals]
        deadline = min(starts) + threshold_ns if seq in waited and starts else float("inf")
        if starts and behind(seq) and all(f.signalled_ns is not None and f.signalled_ns < deadline for f in behind(seq)):
            stop.add(seq)
    return stop


def _threshold_s(pg: str, members: list[RankFacts]) -> float:
    """The group's hang threshold, as the earliest age at which a member reported a hang (0: none did)."""
    return min((f.groups[pg].threshold_s for f in members if pg in f.groups and f.groups[pg].threshold_s), default=0.0)


def _late(f: RankFacts, pg: str, seq: int, live: bool, first_wait_ns: int | None, threshold_s: float) -> str | None:
    """Why rank ``f`` is one the others waited for in ``seq``; None if it is not. After the fact, a
    rank is late when it issued ``seq`` once the first waiting rank had waited the hang threshold."""
    group = f.groups.get(pg)
    if live and f.stopped and f.gone:  # ended by the job's teardown (torchrun stops every rank once one failed)
        return None
    if f.gone and (group is None or group.issued < seq):
        return f"stopped reporting, last at seq {group.issued if group else 0}"
    if group is None:
        return "never issued a collective in this group"
    if seq not in group.arrivals:
        return f"had issued only up to seq {group.issued}" if group.issued < seq else None
    if live:
        return None
    start = group.arrivals[seq][1]
    if first_wait_ns is not None and (start - first_wait_ns) / 1e9 >= threshold_s > 0:
        return f"issued it {(start - first_wait_ns) / 1e9:.1f} s after the first waiting rank"
    return None


def _waiting_elsewhere(f: RankFacts, pg: str, live: bool, first_wait_ns: int | None) -> tuple[str, str] | None:
    """(the group, why) where rank ``f``, behind in group ``pg``, waits itself past the hang threshold
    (live: or its collective there failed), or waits on a peer in a point-to-point op of any group;
    None if it waits nowhere else. After the fact: a wait that went on after the first rank began
    waiting for it in ``pg``."""
    for other, group in sorted(f.groups.items()):
        if group.p2p_hung is not None:
            op, peer, _ = group.p2p_hung
            return other, f"waits itself on rank {peer} in {op} (group {other})"
        if group.p2p_failed is not None and (live or first_wait_ns is None or (group.p2p_failed[2] or 0) <= first_wait_ns
                                             + _threshold_s(pg, [f]) * 1e9):
            op, peer, _ = group.p2p_failed
            return other, f"failed itself on rank {peer} in {op} (group {other})"
        if other == pg:
            continue
        if group.hung is not None:
            return other, f"waits itself in {group.hung[0]} (group {other}) seq {group.hung[1]}"
        if group.failed is not None and live:
            return other, f"failed itself in {group.failed[0]} (group {other}) seq {group.failed[1]}"
        for held, (start, end) in sorted(group.hangs_seen.items()):
            if first_wait_ns is not None and (end is None or end > first_wait_ns) and held in group.arrivals:
                return other, f"waited itself in {group.arrivals[held][0]} (group {other}) seq {held}"
    for other, group in sorted(f.groups.items()):
        for start, end, op, peer in group.p2p_waits_seen:
            if first_wait_ns is not None and (end is None or end > first_wait_ns):
                return other, f"waited itself on rank {peer} in {op} (group {other})"
    return None


def _waiting_earlier(pg: str, members: list[RankFacts], late: dict[int, str], seq: int) -> dict[int, str]:
    """The ranks behind in ``seq`` of group ``pg`` that wait themselves in an earlier collective of the
    same group, past the hang threshold, which a rank further behind has not issued: held up by it (a
    broadcast that gloo relays through a missing rank), they are links of the chain, not its end."""
    issued = {f.rank: f.groups[pg].issued if pg in f.groups else 0 for f in members}
    held = {}
    for f in members:
        group = f.groups.get(pg)
        if f.rank in late and group is not None and _still_hung(group) and group.hung[1] < seq:
            op, earlier = group.hung
            behind = sorted(rank for rank in late if rank != f.rank and issued[rank] < earlier)
            if behind:
                held[f.rank] = f"waits itself in {op} (group {pg}) seq {earlier}, which {_who(behind)} has not issued"
    return held


def _once_each(found: list[Finding]) -> list[Finding]:
    """A killed rank named once: its first finding (the group it died in first), the others' waits in
    its other groups added to the evidence. A rank's stall named once: by the collective it held up,
    where there is one (its pipeline peers' waits on it are the same pause)."""
    first: dict[tuple[int, ...], Finding] = {}
    kept = []
    stalled = {f.ranks for f in found if f.kind == "stall" and f.seq is not None}
    for f in found:
        if f.kind == "stall" and f.seq is None and f.ranks in stalled:
            continue
        if f.kind == "lost_rank" and f.ranks in first:
            where = f"{f.op} (group {f.pg}" + (f", seq {f.seq})" if f.seq is not None else ")")
            also = f.evidence.split("; ", 1)[1] if "; " in f.evidence else ""
            merged = dataclasses.replace(first[f.ranks], evidence=f"{first[f.ranks].evidence}; in {where} too" +
                                         (f": {also}" if also else ""))
            kept[kept.index(first[f.ranks])] = first[f.ranks] = merged
            continue
        kept.append(f)
        if f.kind == "lost_rank":
            first[f.ranks] = f
    return kept


def _lost_unseen(facts: list[RankFacts], found: list[Finding]) -> list[Finding]:
    """A killed rank that no other finding names, because no rank was seen waiting on it (live: the job
    torn down within a scrape; after the fact: its peers completed the collective it died in): named in
    the collective it had in flight, whose op its dump holds and the metrics do not; one that vanished,
    in the collective its peers were still in (``_died_in``)."""
    named = {rank for f in found if f.kind == "lost_rank" for rank in f.ranks}
    unseen = []
    for f in facts:
        if f.lost and f.rank not in named and (in_flight := _died_in(f, facts) if f.vanished else _in_flight(f)):
            pg = min(in_flight, key=lambda group: (len(group), group))
            group = f.groups.get(pg)
            theirs = [_last_issued(other.groups[pg]) for other in facts if other is not f and pg in _in_flight(other)]
            if f.vanished and theirs:  # the collective its peers were in: it died in it, or before it
                seq, op = max(theirs)
                unseen.append(Finding("lost_rank", (f.rank,), pg, op, seq, f"{_death(f)}; the others were still in "
                                      "it when the job was torn down"))
            elif group is None:  # never seen in it: killed before its metrics were first scraped
                unseen.append(Finding("lost_rank", (f.rank,), pg, "a collective", None, f"{_death(f)}, and the job "
                                      "was torn down: the others were told to stop"))
            elif not group.issued and not group.inputs:  # a group of point-to-point ops alone
                unseen.append(Finding("lost_rank", (f.rank,), pg, "a point-to-point op", None,
                                      f"{_death(f)}: its peers' ops with it failed or waited"))
            else:
                seq, op = _last_issued(group)
                unseen.append(Finding("lost_rank", (f.rank,), pg, op, seq, f"{_death(f)} inside it"))
    return unseen


def _last_issued(group: GroupFacts) -> tuple[int, str]:
    """The sequence number and op of the last collective a rank issued in a group ("a collective" where
    its input was not seen)."""
    return group.issued, group.inputs.get(group.issued, ("a collective",))[0]


def _death(f: RankFacts) -> str:
    """How a lost rank's process is known to have ended without a signal or an exception."""
    if f.vanished and f.unreachable:
        return "its metrics endpoint went down with no word of how its process ended (SIGKILL, the OOM killer, a crash)"
    if f.vanished:
        return "its process left no dump and no note that it ended, where the others left theirs (SIGKILL, " \
            "the OOM killer, a crash)"
    return "its process ended without a signal or an exception (SIGKILL, the OOM killer, a crash)"


def _member(f: RankFacts, pg: str) -> bool:
    """Whether rank ``f`` is taken for a member of group ``pg``: it was seen in it; the default group
    "0" is every rank's; a rank that vanished unseen in any group (killed before its first collective
    was scraped) may be in any."""
    return pg in f.groups or pg == "0" or (f.vanished and not f.groups)


def _died_in(f: RankFacts, facts: list[RankFacts]) -> set[str]:
    """The groups of a rank that ``vanished`` in which it died: where another rank failed, or waits (live)
    or was still waiting (after the fact) in a collective or on it (``_member``). None: it vanished while
    the others carried on unharmed, and is not known to have died. (Its own last scrape, or its spans,
    may end before the collective it died in.) Collectives first: where only point-to-point ops on it
    failed or waited, the collectives that ranks told to stop were still in (torchrun stops every rank
    once one has died). Where the job was torn down before any rank was seen waiting (live, or in the
    dumps of ranks signalled within milliseconds of the death): those groups, or else the default group
    "0" — the others said how they ended, it did not."""
    others = [other for other in facts if other.rank != f.rank]
    in_collectives = {pg for other in others for pg, g in other.groups.items() if _member(f, pg) and (
        g.failed or _still_hung(g) or any(end is None for _, end in g.hangs_seen.values()))}
    on_it = {pg for other in others for pg, g in other.groups.items() if _member(f, pg) and (
        (g.p2p_hung or ("", -1))[1] == f.rank or (g.p2p_failed or ("", -1))[1] == f.rank
        or any(end is None and peer == f.rank for _, end, _, peer in g.p2p_waits_seen))}
    told = {pg for other in others if _told_to_stop(other) for pg in _in_flight(other) if _member(f, pg)}
    if in_collectives or on_it:
        return in_collectives or told or on_it
    return (told or {"0"}) if any(_told_to_stop(other) for other in others) else set()


def _told_to_stop(f: RankFacts) -> bool:
    """Whether rank ``f`` ended told to stop (SIGTERM: torchrun tears a job down once a rank has died):
    live, its last scrapes said so and it is gone; after the fact, its dumps say when it was signalled."""
    return (f.stopped and f.gone) or f.signalled_ns is not None


def _in_flight(f: RankFacts) -> set[str]:
    """The groups in which rank ``f`` had a collective issued and not completed (live, or the dump of a rank
    killed or told to stop)."""
    return {pg for pg, g in f.groups.items() if g.finished is not None and g.issued > g.finished}


def _late_peers(facts: list[RankFacts]) -> list[Finding]:
    """The ranks others wait on in point-to-point ops (a pipeline stage's ``recv`` from the one before)
    past the hang threshold, or whose ops with them failed (gloo fails at once on a peer whose process
    ended), that wait nowhere and failed nowhere themselves: late, stopped or gone. Live, the waits now;
    after the fact, those the spans show, resolved or not, the waited-on rank waiting nowhere over most
    of one (not a wait on a rank told to stop first: the job's teardown). A peer that waits itself is a
    link of the chain, whose end another finding names. Nor a peer the job's teardown stopped: an op with a
    rank fails once its process has ended, and a rank told to stop ended so."""
    by_rank = {f.rank: f for f in facts}
    waits: dict[tuple[int, str], list[tuple[str, str, bool]]] = collections.defaultdict(list)
    """(the waited-on rank, group) -> (op, evidence, whether live) of each wait on it."""
    for f in facts:
        for pg, group in sorted(f.groups.items()):
            if group.p2p_hung is not None:
                op, peer, seconds = group.p2p_hung
                if not _waiting([by_rank.get(peer, RankFacts(peer))]):
                    waits[(peer, pg)].append((op, f"rank {f.rank} waits on it in {op} (group {pg}) for {seconds:.1f} s",
                                              True))
            if group.p2p_failed is not None:
                op, peer, at = group.p2p_failed
                culprit = by_rank.get(peer, RankFacts(peer))
                if not _waiting([culprit]) and not culprit.stopped and culprit.signalled_ns is None:
                    waits[(peer, pg)].append((op, f"rank {f.rank}'s {op} with it failed (group {pg})", at is None))
            for start, end, op, peer in group.p2p_waits_seen:
                culprit = by_rank.get(peer, RankFacts(peer))
                until = end if end is not None else max((e for _, e in f.waits if e is not None), default=start)
                if until > start and not _waited_within(culprit, start, until) and not _failed_by(culprit, until) \
                        and not (culprit.signalled_ns is not None and culprit.signalled_ns < until):
                    waits[(peer, pg)].append((op, f"rank {f.rank} waited on it in {op} (group {pg}) for "
                                                  f"{(until - start) / 1e9:.1f} s", False))
    found = []
    for (peer, pg), seen in sorted(waits.items()):
        state = "it stopped reporting" if by_rank.get(peer, RankFacts(peer)).gone else \
            "it waits nowhere itself" if seen[0][2] else "it waited nowhere meanwhile"
        found.append(Finding("late_rank", (peer,), pg, seen[0][0], None, "; ".join([*(why for _, why, _ in seen), state])))
    return found


def _failed_by(f: RankFacts, until: int) -> bool:
    """Whether an op of rank ``f`` failed (a point-to-point op on a peer, or a collective) that it had issued
    by ``until`` (ns; after the fact)."""
    return any((g.p2p_failed and (g.p2p_failed[2] or 0) <= until)
               or (g.failed and g.arrivals.get(g.failed[1], ("", until + 1))[1] <= until) for g in f.groups.values())


def _desync(pg: str, seq: int, wrong: dict[int, str], others: list[int], op: str) -> Finding:
    theirs = ", ".join(sorted(set(wrong.values())))
    return Finding("desync", tuple(sorted(wrong)), pg, theirs, seq,
                   f"issued {theirs} at seq {seq} where ranks {others} issued {op}")


def _mismatch(pg: str, members: list[RankFacts]) -> list[Finding]:
    """After the fact: the first sequence number at which ranks issued different ops."""
    by_seq = _by_seq(pg, members, "arrivals")
    for seq in sorted(by_seq):
        ops = {rank: op for rank, (op, _) in by_seq[seq].items()}
        majority, count = collections.Counter(ops.values()).most_common(1)[0]
        wrong = {rank: op for rank, op in ops.items() if op != majority}
        if wrong and count > len(wrong):
            return [_desync(pg, seq, wrong, sorted(r for r, op in ops.items() if op == majority), majority)]
    return []


def _by_seq(pg: str, members: list[RankFacts], field: str) -> dict[int, dict[int, Any]]:
    """seq -> rank -> its entry in the member's ``GroupFacts`` dict ``field`` (by seq) of group ``pg``."""
    by_seq: dict[int, dict[int, Any]] = collections.defaultdict(dict)
    for f in members:
        for seq, value in getattr(f.groups.get(pg, GroupFacts()), field).items():
            by_seq[seq][f.rank] = value
    return by_seq


SAME_INPUTS = ("all_reduce", "reduce", "broadcast")
"""Ops whose input tensors every rank gives alike, in dtype and size (others, all_gather say, may be uneven)."""


def _size_mismatch(pg: str, members: list[RankFacts]) -> list[Finding]:
    """After the fact, from the dumps: the first collective of the group whose inputs differ between
    ranks that issued the same op, in dtype (any op) or in size (``SAME_INPUTS``): the fewer gave the
    wrong ones. gloo aborts the processes in it ("Received data size doesn't match"), NCCL hangs."""
    by_seq = _by_seq(pg, members, "inputs")
    for seq in sorted(by_seq):
        ops = {op for op, _ in by_seq[seq].values()}
        if len(ops) > 1:  # a desync, told by the ops
            continue
        op = ops.pop()
        if op in SAME_INPUTS:
            told = {rank: tensors for rank, (_, tensors) in by_seq[seq].items()}
        else:  # a scatter's root alone gives inputs, an all_gather's may be uneven: the dtypes given
            told = {rank: _dtypes(tensors) for rank, (_, tensors) in by_seq[seq].items() if tensors}
        if not told:
            continue
        majority, count = collections.Counter(told.values()).most_common(1)[0]
        wrong = sorted(rank for rank, given in told.items() if given != majority)
        if wrong and count > len(wrong):
            theirs = sorted(rank for rank in told if rank not in wrong)
            return [Finding("size_mismatch", tuple(wrong), pg, op, seq,
                            f"its input was {' / '.join(sorted(set(by_seq[seq][r][1] for r in wrong)))} where ranks "
                            f"{theirs} gave {by_seq[seq][theirs[0]][1]}")]
    return []


def _dtypes(tensors: str) -> frozenset[str]:
    """The dtypes of a dump entry's tensors as ``readers`` writes them (``"Float[8], Float[2, 4]"``)."""
    return frozenset(tensor.partition("[")[0] for tensor in tensors.split("], "))


def _least_waiting(groups: dict[int, GroupFacts]) -> tuple[int, float, float] | None:
    """Live: the member that spends least of its time in a group's ops, and waits over ``STRAGGLER_MIN_S``
    less per op than the longest waiter, from ``STRAGGLER_LIVE_EVIDENCE`` ops of each: it arrives last.
    (Members of a group of collectives issue as many, and the share orders them as the mean wait does;
    a pipeline's ends exchange half as often as its middle stages.) (rank, its wait, the longest wait),
    or None. As ``commlens:rank_least_in_group``."""
    waits = {rank: g.wait_s for rank, g in groups.items() if g.wait_s is not None}
    shares = {rank: groups[rank].waited_s or 0.0 for rank in waits}
    if len(waits) < 2 or min(g.completed for g in groups.values()) < STRAGGLER_LIVE_EVIDENCE:
        return None
    longest = max(waits.values())
    rank = min(shares, key=shares.get)
    return (rank, waits[rank], longest) if longest - waits[rank] > STRAGGLER_MIN_S else None


def _last_arrival(groups: dict[int, GroupFacts]) -> tuple[int, float, float] | None:
    """Live: the member that arrives last (``_least_waiting``) and spends well under the time in the
    group's ops of the member that spends most (``_waits_less``): what the others wait for. As
    ``commlens:rank_last_in_group``."""
    arrival = _least_waiting(groups)
    shares = [g.waited_s or 0.0 for g in groups.values()]
    if arrival is None or not _waits_less(groups[arrival[0]].waited_s or 0.0, max(shares)):
        return None
    return arrival


def _computing_node(facts: list[RankFacts]) -> str | None:
    """Live, across nodes: the node each of whose ranks spends less of its time in collectives (all its
    groups) than any rank of another node, by over ``NODE_SLOW_MARGIN``: it computes while they wait.
    As ``commlens:node_computing``."""
    nodes = {f.rank: f.node for f in facts}
    if len(set(nodes.values())) < 2:
        return None
    waited = {f.rank: _in_collectives(f) for f in facts}
    node = nodes[min(waited, key=waited.get)]
    theirs = [w for rank, w in waited.items() if nodes[rank] == node]
    others = [w for rank, w in waited.items() if nodes[rank] != node]
    return node if max(theirs) + NODE_SLOW_MARGIN < min(others) else None


def _node_last(found: list[Finding], facts: list[RankFacts]) -> list[Finding]:
    """Live, when nothing worse is found: the node that computes while the others wait
    (``_computing_node``), every rank of which arrives last in a group it shares with other nodes
    (``_least_waiting``), its endpoints answering and nobody waiting past the hang threshold: the node
    is slow, and named in place of its ranks' straggler findings. Its ranks may wait in the groups
    they share, as everything they do is slow: the stragglers' test of waiting in no other group does
    not hold for them (as CommlensNodeSlow). Behind a slow link the ranks that send across it arrive
    last, but spend as much of their time in collectives as anyone: no node computes while others wait."""
    if _waiting(facts) or any(f.gone or f.unreachable for f in facts) or (node := _computing_node(facts)) is None:
        return _slow_node(found, facts)
    nodes = {f.rank: f.node for f in facts}
    ranks = sorted(rank for rank, n in nodes.items() if n == node)
    last: set[int] = set()
    for pg in {pg for f in facts for pg in f.groups}:
        groups = {f.rank: f.groups[pg] for f in facts if pg in f.groups}
        if len({nodes[rank] for rank in groups}) > 1 and (arrival := _least_waiting(groups)) is not None:
            last.add(arrival[0])
    if not set(ranks) <= last:
        return _slow_node(found, facts)
    return [Finding("node_slow", tuple(ranks), "", "", None,
                    f"every rank of the node arrives last, by over {STRAGGLER_MIN_S * 1e3:.0f} ms per collective, "
                    "in a group it shares with other nodes, and spends less of its time in collectives than any "
                    "rank of another node, and its endpoints answer: the host is alive but slow (its CPU "
                    "throttled or shared, memory, its devices)", node=node)] + \
        [f for f in found if not set(f.ranks) <= set(ranks)]


def _network_slow(facts: list[RankFacts]) -> list[Finding]:
    """Live, when nothing else is found, across nodes: every rank spends under half the time outside
    collectives that it spent at its most in the last 5 min (as CommlensNetworkSlow): the collectives
    take longer on every rank while nobody computes more — they wait on the network, not on a rank."""
    if len({f.node for f in facts}) < 2 or _waiting(facts) or any(f.gone or f.least_waited is None for f in facts):
        return []
    now = {f.rank: _in_collectives(f) for f in facts}
    if not all(1 - now[f.rank] < 0.5 * (1 - f.least_waited) for f in facts):
        return []
    return [Finding("network_slow", tuple(sorted(now)), "", "", None,
                    f"every rank spends {min(now.values()):.0%}–{max(now.values()):.0%} of its time in collectives, "
                    f"where it spent as little as {min(f.least_waited for f in facts):.0%}–"
                    f"{max(f.least_waited for f in facts):.0%} in the last 5 min, and no rank or node is what the "
                    "others wait for: the collectives are slow — look at the links between the nodes")]


def _in_collectives(f: RankFacts) -> float:
    """The share of its time the rank spends in its ops, all its groups together (live: now; after the
    fact: over the job)."""
    return sum(g.waited_s or 0.0 for g in f.groups.values())


def _waiting(facts: Iterable[RankFacts]) -> bool:
    """Whether any of these ranks waits past the hang threshold, or saw an op fail (a collective, or a
    point-to-point op on a peer), in any group."""
    return any(_still_hung(g) or g.p2p_hung or g.failed or g.p2p_failed for f in facts for g in f.groups.values())


def _straggler(pg: str, members: list[RankFacts], everyone: list[RankFacts]) -> list[Finding]:
    groups = {f.rank: f.groups[pg] for f in members if pg in f.groups and not f.gone}
    if len(groups) < 2:
        return []
    if all(g.wait_s is not None for g in groups.values()):  # live: lateness from waits
        if any(g.hung_lately for f in everyone for g in f.groups.values()):
            return []  # the window's waits are a hang's (a late rank's, once), here or where a chain of waits began
        last = _last_arrival(groups)
        if last is None:
            return []
        rank, wait, longest = last
        if not _computes_while_they_wait(rank, groups, everyone):
            return []
        # its cost: the others' time in the group's collectives beyond its own, which they spend
        # waiting for it, as a share of the job's time (every rank's, the window's length)
        caused = sum(max(0.0, g.waited_s - groups[rank].waited_s) for g in groups.values())
        return [Finding("straggler", (rank,), pg, "all", None,
                        f"it waits {wait * 1e3:.1f} ms per collective where the group's longest waiter "
                        f"waits {longest * 1e3:.1f} ms: it arrives about {(longest - wait) * 1e3:.1f} ms after the "
                        f"others; the waits for it cost the job {caused / len(everyone):.1%} of its time over the "
                        "window")]
    if not any(g.arrivals for g in groups.values()):  # point-to-point ops alone: a pipeline's
        return _pipeline_straggler(pg, groups, everyone)
    common = set.intersection(*(set(g.arrivals) for g in groups.values()))
    if len(common) < STRAGGLER_EVIDENCE:  # too few collectives seen by every rank to tell
        return []
    late: dict[int, list[float]] = collections.defaultdict(list)
    last = collections.Counter()
    caused = collections.Counter()  # rank -> seconds the others spent waiting for it
    for seq in common:  # per collective: how long after the first rank each rank arrived
        starts = {rank: g.arrivals[seq][1] for rank, g in groups.items()}
        first = min(starts.values())
        for rank, start in starts.items():
            late[rank].append((start - first) / 1e9)
            caused[rank] += sum(max(0, start - other) for other in starts.values()) / 1e9
        last[max(starts, key=starts.get)] += 1
    mean = {rank: _trimmed_mean(values) for rank, values in late.items()}
    rank, *others = sorted(mean, key=mean.get, reverse=True)
    runner_up = max((mean[r] for r in others), default=0.0)
    if mean[rank] > STRAGGLER_MIN_S and mean[rank] > STRAGGLER_LEAD * runner_up \
            and _computes_while_they_wait(rank, groups, everyone):
        # its cost over all the group's collectives, where spans were sampled (a budget a second): the
        # waits for it per collective seen, times the collectives issued
        issued = max(len(common), *(g.issued for g in groups.values()))
        return [Finding("straggler", (rank,), pg, "all", None,
                        f"over {len(common)} collectives it arrived on average {mean[rank] * 1e3:.1f} ms after the "
                        f"first rank (the next latest rank: {runner_up * 1e3:.1f} ms), last in {last[rank]}; "
                        f"{_cost(caused[rank] / len(common) * issued, everyone)}")]
    return []


def _held_by_stragglers(found: list[Finding], facts: list[RankFacts]) -> list[Finding]:
    """``found`` without the stragglers that share a group with another straggler that spends less of its
    time in its ops, all groups together, than they do: they wait for it there, and arrive last
    elsewhere because of it (a tensor-parallel partner, late to its pipeline's sends): links of its
    chain (as ``commlens:rank_held_by_straggler``)."""
    waited = {f.rank: _in_collectives(f) for f in facts}
    by_rank = {f.rank: f for f in facts}
    stragglers = [(f.ranks[0], f.pg) for f in found if f.kind == "straggler"]

    def held(rank: int) -> bool:
        return any(other != rank and waited[other] < waited[rank] and _member(by_rank[rank], pg)
                   for other, pg in stragglers)
    return [f for f in found if f.kind != "straggler" or not held(f.ranks[0])]


def _pipeline_straggler(pg: str, groups: dict[int, GroupFacts], everyone: list[RankFacts]) -> list[Finding]:
    """After the fact, in a group of point-to-point ops alone (a pipeline's stages, which exchange as
    often as their place in it makes them): the member that spent least of its time in the group's
    ops, well under the member that spent most (``_waits_less``), computing while they waited for it
    (``_computes_while_they_wait``), as live. Not in a group where a member waited long (a one-off stall
    or a late rank, which ``_stalls`` and ``_hang`` name): over the job its share would take that in; nor
    in a job where an op failed (a rank gone: the job torn down, its shares cut short by the fault)."""
    shares = {rank: g.waited_s for rank, g in groups.items() if g.waited_s is not None}
    if len(shares) < len(groups) or any(_waited_long(g) for g in groups.values()):
        return []
    if any(g.failed or g.p2p_failed for f in everyone for g in f.groups.values()):
        return []
    rank, most = min(shares, key=shares.get), max(shares.values())
    if not (_waits_less(shares[rank], most) and _computes_while_they_wait(rank, groups, everyone)):
        return []
    caused = sum(share - shares[rank] for share in shares.values())
    return [Finding("straggler", (rank,), pg, "all", None,
                    f"it spent {shares[rank]:.0%} of its time in the group's point-to-point ops where the member "
                    f"that spent most spent {most:.0%}: they wait for it; the waits for it cost the job "
                    f"{caused / len(everyone):.1%} of its time")]


def _waited_long(g: GroupFacts) -> bool:
    """Whether the rank waited in the group past the hang threshold, or for a stall's ``STALL_MIN_S``
    (after the fact)."""
    slow = [end - start for _, start, end in g.slow_waits.values()] + [end - start for start, end, _, _ in g.p2p_slow_waits]
    return bool(g.hangs_seen or g.p2p_waits_seen) or any(seconds / 1e9 >= STALL_MIN_S for seconds in slow)


def _computes_while_they_wait(rank: int, groups: dict[int, GroupFacts], everyone: list[RankFacts]) -> bool:
    """Whether ``rank``, last to arrive in a group of ``groups``' members, straggles: arriving last in one
    group because it waited in another is not straggling. A straggler spends well under the time in its
    ops, all its groups together, of the member that spends most (``_waits_less``; live over the
    window, after the fact over the job: ``GroupFacts.waited_s``), its own compute holding them up; and
    one that waits now past the hang threshold is a link of a chain that another finding names."""
    waited = {f.rank: _in_collectives(f) for f in everyone if f.rank in groups}
    return not _waiting(f for f in everyone if f.rank == rank) and _waits_less(waited[rank], max(waited.values()))


def _waits_less(share: float, most: float) -> bool:
    """Whether a member that spends ``share`` of its time in its ops waits so much less than the one that
    spends ``most`` that it is what they wait for: under ``STRAGGLER_RATIO`` of it, or ``STRAGGLER_GAP``
    of the wall clock less. (Where most wait over 5/8 of their time, a pipeline's bubble, the ratio would
    ask a straggler to wait hardly at all: a first stage waits for its gradients however slow it is.)

    >>> _waits_less(0.1, 0.3), _waits_less(0.4, 0.79), _waits_less(0.32, 0.55), _waits_less(0.35, 0.55)
    (True, True, True, False)"""
    return share < most - min((1 - STRAGGLER_RATIO) * most, STRAGGLER_GAP)  # as commlens:rank_last_in_group


def _stalls(pg: str, members: list[RankFacts], everyone: list[RankFacts]) -> list[Finding]:
    """One-off stalls, after the fact: a collective of the group that some members waited in long (a
    slow outlier of at least ``STALL_MIN_S``, under the hang threshold) and others did not. Those
    arrived late, and are named, unless they waited themselves in another group or on a peer
    meanwhile: held up there, they are links of a chain whose end is named in that group. (The late
    rank's own part may be a slow outlier too, on a loaded host: tens of ms where it takes one.)"""
    groups = {f.rank: f.groups[pg] for f in members if pg in f.groups}
    found = []
    for seq, slow in sorted(_by_seq(pg, members, "slow_waits").items()):
        waiting = {rank: wait for rank, wait in slow.items() if (wait[2] - wait[1]) / 1e9 >= STALL_MIN_S}
        if not waiting:
            continue
        waited_s = min(end - start for _, start, end in waiting.values()) / 1e9
        since, until = max(start for _, start, _ in waiting.values()), min(end for _, _, end in waiting.values())
        late = [f.rank for f in members if f.rank in groups and f.rank not in waiting and seq <= groups[f.rank].issued
                and not _waited_within(f, since, until)]
        if late and len(late) < len(groups):
            op = collections.Counter(op for op, _, _ in waiting.values()).most_common(1)[0][0]
            found.append(Finding("stall", tuple(late), pg, op, seq,
                                 f"ranks {sorted(waiting)} waited {waited_s:.1f} s in it, several times their usual "
                                 f"wait and under the hang threshold, while ranks {late} waited nowhere; "
                                 f"{_cost(sum(end - start for _, start, end in waiting.values()) / 1e9, everyone)}"))
    return found


def _peer_stalls(pg: str, members: list[RankFacts], everyone: list[RankFacts]) -> list[Finding]:
    """One-off stalls of a peer, after the fact: point-to-point ops of the group that ranks waited in long
    on one peer (a slow outlier of at least ``STALL_MIN_S``, under the hang threshold), together, while
    that peer waited nowhere: it stalled (a pipeline's stage that paused once). A peer that waited
    itself meanwhile, on its own peer or in a collective, is a link of the chain, named where its wait
    leads."""
    by_rank = {f.rank: f for f in everyone}
    on_peer: dict[int, list[tuple[int, int, int, str]]] = collections.defaultdict(list)
    for f in members:
        for start, end, op, peer in f.groups[pg].p2p_slow_waits if pg in f.groups else ():
            if (end - start) / 1e9 >= STALL_MIN_S:
                on_peer[peer].append((start, end, f.rank, op))
    found = []
    for peer, waits in sorted(on_peer.items()):
        if peer not in by_rank:
            continue
        for episode in _overlapping(sorted(waits)):
            since, until = max(w[0] for w in episode), min(w[1] for w in episode)
            if _waited_within(by_rank[peer], since, until):
                continue
            waiters = sorted({rank for _, _, rank, _ in episode})
            op = collections.Counter(op for *_, op in episode).most_common(1)[0][0]
            found.append(Finding("stall", (peer,), pg, op, None,
                                 f"ranks {waiters} waited {(until - since) / 1e9:.1f} s on it in {op}, several times "
                                 f"their usual wait and under the hang threshold, while it waited nowhere; "
                                 f"{_cost(sum(end - start for start, end, _, _ in episode) / 1e9, everyone)}"))
    return found


def _overlapping(waits: list[tuple[int, int, int, str]]) -> list[list[tuple[int, int, int, str]]]:
    """``waits`` (start ns, end ns, ...; sorted) in runs that overlap: one episode each."""
    episodes: list[list[tuple[int, int, int, str]]] = []
    for wait in waits:
        if episodes and wait[0] < min(w[1] for w in episodes[-1]):
            episodes[-1].append(wait)
        else:
            episodes.append([wait])
    return episodes


def _cost(caused_s: float, everyone: list[RankFacts]) -> str:
    """What the waits a culprit caused cost the job, after the fact: rank-seconds, and their share of
    the job's time (every rank's, from its first collective seen to its last)."""
    starts = [start for f in everyone for g in f.groups.values() for _, start in g.arrivals.values()]
    seconds = (max(starts) - min(starts)) / 1e9 if starts else 0.0
    share = f", {caused_s / (len(everyone) * seconds):.1%} of its time" if seconds > 0 else ""
    return f"the waits for it cost the job {caused_s:.1f} rank-seconds{share}"


def _waited_within(facts: RankFacts, since: int, until: int) -> bool:
    """Whether the rank waited long (in any group, on any peer) over most of ``since`` to ``until``
    (ns; from the same host's clock as its own waits, in a job of one node)."""
    return any(min(until, end if end is not None else until) - max(since, start) > (until - since) / 2
               for start, end in facts.waits)


def _trimmed_mean(values: list[float]) -> float:
    """The mean without the highest and lowest tenth: a warm-up step's spikes do not make a straggler."""
    values = sorted(values)
    cut = len(values) // 10
    return statistics.fmean(values[cut:len(values) - cut])
