"""The detectors: ``findings()`` turns ranks' facts into verdicts of the catalogue's kinds, the same way
whatever the source (docs/verdicts.md says what each detector finds and why); each family of kinds in
a module of its own (``nonfinite``, ``hangs``, ``mismatches``, ``ends``, ``slowness``), reading waits
one way (``waits``).

Example::

    for finding in findings(readers.from_files("./commlens-out/job-7")):
        print(finding.line())
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from ..catalogue import KINDS
from ..facts import RankFacts
from ..finding import Finding
from .ends import died_in, lost_unseen, unreachable_nodes
from .hangs import hang, late_peers
from .mismatches import mismatch, size_mismatch
from .nonfinite import nan_origins
from .replicas import diverging_inputs, replica_mismatches
from .slowness import held_by_stragglers, network_slow, node_last, peer_stalls, slow_node, stalls, straggler
from .waits import member


def findings(facts: Iterable[RankFacts]) -> list[Finding]:
    """Every verdict the facts support, most severe first; [] for a healthy job. The waits form a
    graph: culprits are the ends of its chains, links are evidence, a round is a deadlock
    (docs/verdicts.md)."""
    facts = list(facts)
    facts = [dataclasses.replace(f, lost=True) if f.vanished and died_in(f, facts) else f for f in facts]
    found: list[Finding] = []
    links: list[Finding] = []
    found += nan_origins(facts)
    for pg in sorted({pg for f in facts for pg in f.groups}):
        members = [f for f in facts if member(f, pg)]
        stuck = hang(pg, members, facts)
        links += [f for f in stuck if f.kind == "deadlock"]
        stuck = [f for f in stuck if f.kind != "deadlock"]
        if not any(f.kind == "desync" for f in stuck):
            stuck += mismatch(pg, members)
        mismatched = size_mismatch(pg, members)
        if mismatched:  # the backend fails or aborts the ranks in it: their hang or death there follows from it
            stuck = [f for f in stuck if f.kind == "desync" or (f.seq or 0) < mismatched[0].seq] + mismatched
        found += stuck + replica_mismatches(pg, members) + diverging_inputs(pg, members)
        if not stuck and not any(f.pg == pg for f in links) and not any(f.lost for f in members):
            found += straggler(pg, members, facts) + stalls(pg, members, facts) + peer_stalls(pg, members, facts)
    found = _once_each(held_by_stragglers(found, facts) + lost_unseen(facts, found))
    lost = {rank for f in found if f.kind == "lost_rank" for rank in f.ranks}
    # a killed rank that a pipeline peer waits on is named once, as killed
    found += [f for f in late_peers(facts) if not set(f.ranks) <= lost]
    unreachable = unreachable_nodes(facts)
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
    found = slow_node(found, facts) if any(f.kind != "straggler" for f in found) else node_last(found, facts)
    if not found:
        found = network_slow(facts)
    order = [kind.name for kind in KINDS]
    return sorted(found, key=lambda f: order.index(f.kind))


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
