"""Hangs and late ranks: in a group collective the ranks that issued sequence S wait on those that have
not; in a point-to-point op the receiver waits on its source; the culprits are the ends of the chains."""

from __future__ import annotations

import collections

from ..facts import GroupFacts, RankFacts
from ..finding import Finding
from .ends import death, died_in, groups_in_flight
from .mismatches import SAME_INPUTS, desync
from .waits import hang_threshold_s, starting, still_hung, waited_within, waiting, who


def hang(pg: str, members: list[RankFacts], everyone: list[RankFacts]) -> list[Finding]:
    """Late, missing and desynced ranks around the collective others hang in; a "deadlock" link when
    every rank behind waits itself in another group (``findings`` follows the chain)."""
    stop = _waits_of_the_stop(pg, members)
    live = {f.rank: state for f in members if pg in f.groups and (state := next(
        (s for s in (f.groups[pg].hung if still_hung(f.groups[pg]) else None, f.groups[pg].failed)
         if s is not None and s[1] not in stop), None))}
    # live: a killed rank is named in the collective it died in, the one it had in flight; the waits in
    # another group (one that resolved, say) are not its death's, nor is a wait it has since come out of
    # (at start-up, for a rank still building its model) a hang
    lost = sorted(f.rank for f in members if f.lost and pg in (died_in(f, everyone) if f.vanished else groups_in_flight(f)
                                                                 or {pg}))
    if not lost and any(f.lost for f in members):
        return []
    if live:
        seq = collections.Counter(s for _, s in live.values()).most_common(1)[0][0]
        ops = {rank: op for rank, (op, s) in live.items() if s == seq}
    else:  # after the fact: a hang that resolved, known from the spans of the ranks that waited
        waited = {s for f in members if pg in f.groups for s in f.groups[pg].hangs_seen} - stop
        waited -= _start_up(pg, members, waited)
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
                        f"{death(dead)}" + (f"; ranks {others} waited in or failed in seq {seq}" if others else ""))]
    found = []
    wrong = sorted(rank for rank, op in ops.items() if op != majority)
    if wrong and count > len(wrong):
        found.append(desync(pg, seq, {r: ops[r] for r in wrong}, waiting, majority))
    starts = [f.groups[pg].arrivals[seq][1] for f in members if f.rank in waiting and seq in f.groups[pg].arrivals]
    first_wait, threshold_s = min(starts, default=None), hang_threshold_s(pg, members)
    late = {f.rank: why for f in members if f.rank not in ops
            and (why := _late(f, pg, seq, bool(live), first_wait, threshold_s)) is not None}
    elsewhere = {rank: where for rank in late if (where := _waiting_elsewhere(
        next(f for f in everyone if f.rank == rank), pg, bool(live), first_wait)) is not None}
    # live, a rank the job's teardown ended while behind (not late itself: ``_late``) holds the others up
    # where it waited in another group then, a link of the chain; where it waited nowhere, nobody is at fault
    torn_down = [f for f in members if live and f.rank not in ops and f.rank not in late and f.stopped and f.gone
                 and (pg not in f.groups or f.groups[pg].issued < seq)]
    for f in torn_down:
        if (where := _waiting_elsewhere(f, pg, True, first_wait)) is not None:
            late[f.rank], elsewhere[f.rank] = "was behind as the job was stopped", where
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
        if torn_down or any(f.vanished and f.lost for f in everyone):  # behind when stopped; gone without a
            return []  # word, maybe before it was seen in pg
        found.append(Finding("hang", tuple(waiting), pg, majority, seq,
                             f"ranks {waiting} wait in seq {seq} and no rank is behind: look at the network "
                             "or the backend"))
    return found


def _unmatched(pg: str, members: list[RankFacts], seq: int, ops: dict[int, str], waiting: list[int], how: str,
               op: str) -> Finding | None:
    """Live: ranks that wait in a collective every other member of the group completed, or whose wait
    there ended in its failure (the backend's timeout). Their side of it did not match the others' — gloo
    waits for the bytes a larger input expects — or their own link failed: a size mismatch as the
    metrics show it (the dumps show the inputs)."""
    others = [f for f in members if f.rank not in ops]
    if not others or any(pg not in f.groups or (f.groups[pg].finished or 0) < seq for f in others):
        return None
    if not all(still_hung(f.groups[pg]) or _timed_out(f.groups[pg], seq) for f in members if f.rank in waiting):
        return None  # a wait it has since come out of, or a failure alone (a peer's process ended)
    return Finding("size_mismatch", tuple(waiting), pg, op, seq,
                   f"ranks {[f.rank for f in others]} completed it and {who(waiting)} {how} it: its side did not "
                   "match theirs (an input of another size or dtype; the dumps show each rank's), or its link failed")


def _timed_out(g: GroupFacts, seq: int) -> bool:
    """Its wait past the hang threshold in ``seq`` ended in that collective's failure."""
    return g.hung is not None and g.failed is not None and g.hung[1] == g.failed[1] == seq


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
    threshold_ns = hang_threshold_s(pg, members) * 1e9
    waited = {s for f in members if pg in f.groups for s in f.groups[pg].hangs_seen}
    for seq in waited | failed:
        starts = [f.groups[pg].arrivals[seq][1] for f in members if pg in f.groups and seq in f.groups[pg].arrivals]
        deadline = min(starts) + threshold_ns if seq in waited and starts else float("inf")
        if starts and behind(seq) and all(f.signalled_ns is not None and f.signalled_ns < deadline for f in behind(seq)):
            stop.add(seq)
    return stop


def _start_up(pg: str, members: list[RankFacts], waited: set[int]) -> set[int]:
    """After the fact, the seqs among ``waited`` whose waits were the job's start-up (``starting``): the
    group's first collective, which every member issued, each rank that issued it a hang threshold or
    more after the first waiting rank as its first op of all. Ranks start at their own pace; one that
    never came is named (``_late``), and live, one is named while the others wait for it."""
    threshold_ns = hang_threshold_s(pg, members) * 1e9
    if 1 not in waited or not threshold_ns or any(pg not in f.groups or 1 not in f.groups[pg].arrivals for f in members):
        return set()
    first_wait = min(f.groups[pg].hangs_seen[1][0] for f in members if 1 in f.groups[pg].hangs_seen)
    late = [f for f in members if f.groups[pg].arrivals[1][1] - first_wait >= threshold_ns]
    return {1} if late and all(starting(f, f.groups[pg].arrivals[1][1]) for f in late) else set()


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
                                             + hang_threshold_s(pg, [f]) * 1e9):
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
        if f.rank in late and group is not None and still_hung(group) and group.hung[1] < seq:
            op, earlier = group.hung
            behind = sorted(rank for rank in late if rank != f.rank and issued[rank] < earlier)
            if behind:
                held[f.rank] = f"waits itself in {op} (group {pg}) seq {earlier}, which {who(behind)} has not issued"
    return held


def late_peers(facts: list[RankFacts]) -> list[Finding]:
    """The ranks others wait on in point-to-point ops (a pipeline stage's ``recv`` from the one before)
    past the hang threshold, or whose ops with them failed (gloo fails at once on a peer whose process
    ended), that wait nowhere and failed nowhere themselves: late, stopped or gone. Live, the waits now;
    after the fact, those the spans show, resolved or not, the waited-on rank waiting nowhere over most
    of one (not a wait on a rank told to stop first: the job's teardown). A peer that waits itself is a
    link of the chain, whose end another finding names. Nor a peer the job's teardown stopped: an op with a
    rank fails once its process has ended, and a rank told to stop ended so. Nor, after the fact, a wait
    that began before the peer's first op of all and ended: the job's start-up (``starting``)."""
    by_rank = {f.rank: f for f in facts}
    waits: dict[tuple[int, str], list[tuple[str, str, bool]]] = collections.defaultdict(list)
    """(the waited-on rank, group) -> (op, evidence, whether live) of each wait on it."""
    for f in facts:
        for pg, group in sorted(f.groups.items()):
            if group.p2p_hung is not None:
                op, peer, seconds = group.p2p_hung
                if not waiting([by_rank.get(peer, RankFacts(peer))]):
                    waits[(peer, pg)].append((op, f"rank {f.rank} waits on it in {op} (group {pg}) for {seconds:.1f} s",
                                              True))
            if group.p2p_failed is not None:
                op, peer, at = group.p2p_failed
                culprit = by_rank.get(peer, RankFacts(peer))
                if not waiting([culprit]) and not culprit.stopped and culprit.signalled_ns is None:
                    waits[(peer, pg)].append((op, f"rank {f.rank}'s {op} with it failed (group {pg})", at is None))
            for start, end, op, peer in group.p2p_waits_seen:
                culprit = by_rank.get(peer, RankFacts(peer))
                until = end if end is not None else max((e for e in f.waits.values() if e is not None), default=start)
                if until > start and not waited_within(culprit, start, until) and not _failed_by(culprit, until) \
                        and not (culprit.signalled_ns is not None and culprit.signalled_ns < until) \
                        and not (end is not None and starting(culprit, start)):
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
