"""Slowness without a hang: stragglers (a rank whose own work holds its groups up every step), one-off
stalls, a slow node and a slow network, judged from arrivals and the time ranks spend in collectives."""

from __future__ import annotations

import collections
import statistics

from ..facts import END_WINDOW_S, GroupFacts, RankFacts
from ..finding import Finding
from .waits import cost, in_collectives, member, ranks_by_seq, starting, waited_within, waiting, who


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


NODE_SLOW_MARGIN = 0.06
"""A slow node's ranks spend less of their time in collectives than any other node's by more than this
(a healthy pipeline's ends on a busy host, by up to 5.4 % for a second or a few; docs/verdicts.md)."""


STRAGGLER_LEAD = 1.5
"""... or, after the fact, arrives later on average than this many times the next latest rank."""


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
    waited = {f.rank: in_collectives(f) for f in facts}
    node = nodes[min(waited, key=waited.get)]
    theirs = [w for rank, w in waited.items() if nodes[rank] == node]
    others = [w for rank, w in waited.items() if nodes[rank] != node]
    return node if max(theirs) + NODE_SLOW_MARGIN < min(others) else None


def node_last(found: list[Finding], facts: list[RankFacts]) -> list[Finding]:
    """Live, when nothing worse is found: the node that computes while the others wait
    (``_computing_node``), every rank of which arrives last in a group it shares with other nodes
    (``_least_waiting``), its endpoints answering and nobody waiting past the hang threshold: the node
    is slow, and named in place of its ranks' straggler findings. Its ranks may wait in the groups
    they share, as everything they do is slow: the stragglers' test of waiting in no other group does
    not hold for them (as CommlensNodeSlow). Behind a slow link the ranks that send across it arrive
    last, and spend as much of their time in collectives as anyone, or a few % less; but they, as every
    rank, wait on the network (``_waits_on_network``), where a slow node's ranks compute longer."""
    if waiting(facts) or any(f.gone or f.unreachable for f in facts) or (node := _computing_node(facts)) is None:
        return slow_node(found, facts)
    nodes = {f.rank: f.node for f in facts}
    ranks = sorted(rank for rank, n in nodes.items() if n == node)
    last: set[int] = set()
    for pg in {pg for f in facts for pg in f.groups}:
        groups = {f.rank: f.groups[pg] for f in facts if pg in f.groups}
        if len({nodes[rank] for rank in groups}) > 1 and (arrival := _least_waiting(groups)) is not None:
            last.add(arrival[0])
    if not set(ranks) <= last or any(_waits_on_network(f) for f in facts if f.node == node):
        return slow_node(found, facts)
    return [Finding("node_slow", tuple(ranks), "", "", None,
                    f"every rank of the node arrives last, by over {STRAGGLER_MIN_S * 1e3:.0f} ms per collective, "
                    "in a group it shares with other nodes, and spends less of its time in collectives than any "
                    "rank of another node, and its endpoints answer: the host is alive but slow (its CPU "
                    "throttled or shared, memory, its devices)", node=node)] + \
        [f for f in found if not set(f.ranks) <= set(ranks)]


def slow_node(found: list[Finding], facts: list[RankFacts]) -> list[Finding]:
    """When the ranks found late, straggling or stalled are every rank of one node (two or more) and
    nobody else is blamed, the node is named instead, alive but slow: its endpoints answer (an
    unreachable node is ``unreachable_nodes``')."""
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
    how = "; ".join(f"{who(list(f.ranks))} {f.kind.replace('_rank', '')} in group {f.pg}" for f in blamed)
    return [Finding("node_slow", tuple(members), blamed[0].pg, blamed[0].op, blamed[0].seq,
                    f"every rank of the node, and only they, are what the others wait for ({how}), and its "
                    "endpoints answer: the host is alive but slow (its CPU throttled or shared, memory, a stall)",
                    node=node)] + [f for f in found if f not in blamed]


def network_slow(facts: list[RankFacts]) -> list[Finding]:
    """Live, when nothing else is found, across nodes: every rank spends under half the time outside
    collectives that it spent at its most in the last 5 min (as CommlensNetworkSlow): the collectives
    take longer on every rank while nobody computes more — they wait on the network, not on a rank."""
    if len({f.node for f in facts}) < 2 or waiting(facts) or any(f.gone or f.least_waited is None for f in facts):
        return []
    if not all(_waits_on_network(f) for f in facts):
        return []
    now = {f.rank: in_collectives(f) for f in facts}
    return [Finding("network_slow", tuple(sorted(now)), "", "", None,
                    f"every rank spends {min(now.values()):.0%}–{max(now.values()):.0%} of its time in collectives, "
                    f"where it spent as little as {min(f.least_waited for f in facts):.0%}–"
                    f"{max(f.least_waited for f in facts):.0%} in the last 5 min, and no rank or node is what the "
                    "others wait for: the collectives are slow — look at the links between the nodes")]


def _waits_on_network(f: RankFacts) -> bool:
    """Live: whether the rank spends under half the time outside collectives that it spent at its most in
    the last 5 min: its collectives slowed while its own work did not (as ``commlens:rank_waits_on_network``).

    >>> _waits_on_network(RankFacts(rank=0, least_waited=0.1, groups={"0": GroupFacts(waited_s=0.9)}))
    True"""
    return f.least_waited is not None and 1 - in_collectives(f) < 0.5 * (1 - f.least_waited)


def straggler(pg: str, members: list[RankFacts], everyone: list[RankFacts]) -> list[Finding]:
    groups = {f.rank: f.groups[pg] for f in members if pg in f.groups and not f.gone}
    if len(groups) < 2:
        return []
    if all(g.wait_s is not None for g in groups.values()):  # live: lateness from waits
        if any(g.hung_lately for f in everyone for g in f.groups.values()):
            return []  # the window's waits are a hang's (a late rank's, once), here or where a chain of waits began
        if not all(_window_full(f) for f in members if f.rank in groups):
            return []  # a member's share of its time in collectives, all groups together, is not known yet
        last = _last_arrival(groups)
        if last is None:
            return []
        rank, wait, longest = last
        if not _computes_while_they_wait(rank, groups, everyone):
            return []
        if not any(g.issued for g in groups.values()) and _with_peers(rank, everyone):
            return []  # a pipeline's stage late to the next by its work, on time with its peers
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
    common = set.intersection(*(set(g.arrivals) for g in groups.values())) - \
        {seq for f in members if pg in f.groups for seq, (_, at) in f.groups[pg].arrivals.items() if starting(f, at)}
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
    if mean[rank] > STRAGGLER_MIN_S and mean[rank] > STRAGGLER_LEAD * runner_up and any(
            _computes_while_they_wait(rank, groups, everyone, at_end) for at_end in _views(groups, everyone)):
        # its cost over all the group's collectives, where spans were sampled (a budget a second): the
        # waits for it per collective seen, times the collectives issued
        issued = max(len(common), *(g.issued for g in groups.values()))
        return [Finding("straggler", (rank,), pg, "all", None,
                        f"over {len(common)} collectives it arrived on average {mean[rank] * 1e3:.1f} ms after the "
                        f"first rank (the next latest rank: {runner_up * 1e3:.1f} ms), last in {last[rank]}; "
                        f"{cost(caused[rank] / len(common) * issued, everyone)}")]
    return []


def _window_full(f: RankFacts) -> bool:
    """Live: whether the window holds each of the rank's groups whole (``GroupFacts.window_partial``):
    at a job's start a group whose first op came within the window is left out of the rank's share of
    its time in collectives, all groups together, which is then too low (a matrix cell saw a healthy
    last stage named so, 7 s after its data-parallel group's first all_reduce). Two scrapes of the
    endpoints hold a group that began between them whole: its counters start at 0.

    >>> _window_full(RankFacts(rank=0, groups={"5": GroupFacts(wait_s=0.01), "11": GroupFacts(window_partial=True)}))
    False"""
    return not any(g.window_partial for g in f.groups.values())


def held_by_stragglers(found: list[Finding], facts: list[RankFacts]) -> list[Finding]:
    """``found`` without the stragglers that share a group with another straggler that spends less of its
    time in its ops, all groups together, than they do: they wait for it there, and arrive last
    elsewhere because of it (a tensor-parallel partner, late to its pipeline's sends): links of its
    chain (as ``commlens:rank_held_by_straggler``)."""
    waited = {f.rank: in_collectives(f) for f in facts}
    by_rank = {f.rank: f for f in facts}
    stragglers = [(f.ranks[0], f.pg) for f in found if f.kind == "straggler"]

    def held(rank: int) -> bool:
        return any(other != rank and waited[other] < waited[rank] and member(by_rank[rank], pg)
                   for other, pg in stragglers)
    return [f for f in found if f.kind != "straggler" or not held(f.ranks[0])]


def _with_peers(rank: int, everyone: list[RankFacts]) -> bool:
    """Whether a group of collectives judges ``rank``: two members or more, not the whole job (whose
    group spans every pipeline stage), each with enough ops (live, ``STRAGGLER_LIVE_EVIDENCE`` in the
    window; after the fact, ``STRAGGLER_EVIDENCE`` seen by every member). Its members, tensor- or
    data-parallel peers, do the same work, and a straggler makes them wait for it there: a rank with
    peers that arrives last only in a pipeline's point-to-point group does its stage's work (a last
    stage computes the loss besides). As ``commlens:rank_with_peers``.

    >>> live = lambda issued, completed: GroupFacts(issued=issued, wait_s=0.01, completed=completed)
    >>> job = lambda ops: [RankFacts(rank=r, groups={"2": live(40, ops)} if r < 2 else {}) for r in range(3)]
    >>> _with_peers(0, job(20)), _with_peers(0, job(3))  # enough ops, too few
    (True, False)"""
    for pg in next(f for f in everyone if f.rank == rank).groups:
        members = [f for f in everyone if pg in f.groups]
        groups = [f.groups[pg] for f in members if not f.gone]
        if not 2 <= len(members) < len(everyone) or len(groups) < 2:
            continue
        if all(g.wait_s is not None for g in groups):  # live
            if all(g.issued for g in groups) and min(g.completed for g in groups) >= STRAGGLER_LIVE_EVIDENCE:
                return True
        elif all(g.arrivals for g in groups) and \
                len(set.intersection(*(set(g.arrivals) for g in groups))) >= STRAGGLER_EVIDENCE:
            return True
    return False


def _pipeline_straggler(pg: str, groups: dict[int, GroupFacts], everyone: list[RankFacts]) -> list[Finding]:
    """After the fact, in a group of point-to-point ops alone (a pipeline's stages, which exchange as
    often as their place in it makes them): the member that spent least of its time in the group's
    ops, well under the member that spent most (``_waits_less``), computing while they waited for it
    (``_computes_while_they_wait``), as live: over the job, or over its last seconds (``_views``). Not
    in a group where a member waited long (a one-off stall or a late rank, which ``stalls`` and ``hang``
    name): over the job its share would take that in; nor in a job where an op failed (a rank gone: the
    job torn down, its shares cut short by the fault); nor a rank with peers (``_with_peers``)."""
    if any(_waited_long(g) for g in groups.values()):
        return []
    if any(g.failed or g.p2p_failed for f in everyone for g in f.groups.values()):
        return []
    for at_end in _views(groups, everyone):
        shares = {rank: g.waited_at_end_s if at_end else g.waited_s for rank, g in groups.items()}
        if any(share is None for share in shares.values()):
            continue
        rank, most = min(shares, key=shares.get), max(shares.values())
        if _waits_less(shares[rank], most) and _computes_while_they_wait(rank, groups, everyone, at_end) \
                and not _with_peers(rank, everyone):
            caused = sum(share - shares[rank] for share in shares.values())
            over = f"its last {END_WINDOW_S:.0f} s" if at_end else "the job"
            return [Finding("straggler", (rank,), pg, "all", None,
                            f"it spent {shares[rank]:.0%} of its time in the group's point-to-point ops where the "
                            f"member that spent most spent {most:.0%}, over {over}: they wait for it; the waits "
                            f"for it cost the job {caused / len(everyone):.1%} of its time then")]
    return []


def _views(groups: dict[int, GroupFacts], everyone: list[RankFacts]) -> tuple[bool, ...]:
    """After the fact, the times a straggler is judged over: the job (False), and its last seconds (True:
    a straggler that began mid-job, diluted over the whole), unless a rank of the job waited long or an
    op failed (the job's end is then that fault's, which other findings name)."""
    troubled = any(_waited_long(g) or g.failed or g.p2p_failed for f in everyone for g in f.groups.values())
    return (False,) if troubled or any(g.waited_at_end_s is None for g in groups.values()) else (False, True)


def _waited_long(g: GroupFacts) -> bool:
    """Whether the rank waited in the group past the hang threshold, or for a stall's ``STALL_MIN_S``
    (after the fact)."""
    slow = [end - start for _, start, end in g.slow_waits.values()] + [end - start for start, end, _, _ in g.p2p_slow_waits]
    return bool(g.hangs_seen or g.p2p_waits_seen) or any(seconds / 1e9 >= STALL_MIN_S for seconds in slow)


def _computes_while_they_wait(rank: int, groups: dict[int, GroupFacts], everyone: list[RankFacts],
                              at_end: bool = False) -> bool:
    """Whether ``rank``, last to arrive in a group of ``groups``' members, straggles: arriving last in one
    group because it waited in another is not straggling. A straggler spends well under the time in its
    ops, all its groups together, of the member that spends most (``_waits_less``; live over the
    window, after the fact over the job: ``GroupFacts.waited_s``), its own compute holding them up; and
    one that waits now past the hang threshold is a link of a chain that another finding names."""
    waited = {f.rank: in_collectives(f, at_end) for f in everyone if f.rank in groups}
    return not waiting(f for f in everyone if f.rank == rank) and _waits_less(waited[rank], max(waited.values()))


def _waits_less(share: float, most: float) -> bool:
    """Whether a member that spends ``share`` of its time in its ops waits so much less than the one that
    spends ``most`` that it is what they wait for: under ``STRAGGLER_RATIO`` of it, or ``STRAGGLER_GAP``
    of the wall clock less. (Where most wait over 5/8 of their time, a pipeline's bubble, the ratio would
    ask a straggler to wait hardly at all: a first stage waits for its gradients however slow it is.)

    >>> _waits_less(0.1, 0.3), _waits_less(0.4, 0.79), _waits_less(0.32, 0.55), _waits_less(0.35, 0.55)
    (True, True, True, False)"""
    return share < most - min((1 - STRAGGLER_RATIO) * most, STRAGGLER_GAP)  # as commlens:rank_last_in_group


def stalls(pg: str, members: list[RankFacts], everyone: list[RankFacts]) -> list[Finding]:
    """One-off stalls, after the fact: a collective of the group that some members waited in long (a
    slow outlier of at least ``STALL_MIN_S``, under the hang threshold) and others did not. Those
    arrived late, and are named, unless they waited themselves in another group or on a peer
    meanwhile: held up there, they are links of a chain whose end is named in that group. (The late
    rank's own part may be a slow outlier too, on a loaded host: tens of ms where it takes one.)"""
    groups = {f.rank: f.groups[pg] for f in members if pg in f.groups}
    found = []
    for seq, slow in sorted(ranks_by_seq(pg, members, "slow_waits").items()):
        waiting = {rank: wait for rank, wait in slow.items() if (wait[2] - wait[1]) / 1e9 >= STALL_MIN_S}
        if not waiting:
            continue
        waited_s = min(end - start for _, start, end in waiting.values()) / 1e9
        since, until = max(start for _, start, _ in waiting.values()), min(end for _, _, end in waiting.values())
        late = [f.rank for f in members if f.rank in groups and f.rank not in waiting and seq <= groups[f.rank].issued
                and not waited_within(f, since, until)]
        if late and len(late) < len(groups):
            op = collections.Counter(op for op, _, _ in waiting.values()).most_common(1)[0][0]
            found.append(Finding("stall", tuple(late), pg, op, seq,
                                 f"ranks {sorted(waiting)} waited {waited_s:.1f} s in it, several times their usual "
                                 f"wait and under the hang threshold, while ranks {late} waited nowhere; "
                                 f"{cost(sum(end - start for _, start, end in waiting.values()) / 1e9, everyone)}"))
    return found


def peer_stalls(pg: str, members: list[RankFacts], everyone: list[RankFacts]) -> list[Finding]:
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
            if waited_within(by_rank[peer], since, until):
                continue
            waiters = sorted({rank for _, _, rank, _ in episode})
            op = collections.Counter(op for *_, op in episode).most_common(1)[0][0]
            found.append(Finding("stall", (peer,), pg, op, None,
                                 f"ranks {waiters} waited {(until - since) / 1e9:.1f} s on it in {op}, several times "
                                 f"their usual wait and under the hang threshold, while it waited nowhere; "
                                 f"{cost(sum(end - start for start, end, _, _ in episode) / 1e9, everyone)}"))
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


def _trimmed_mean(values: list[float]) -> float:
    """The mean without the highest and lowest tenth: a warm-up step's spikes do not make a straggler."""
    values = sorted(values)
    cut = len(values) // 10
    return statistics.fmean(values[cut:len(values) - cut])
