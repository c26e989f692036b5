"""What the verdict is drawn from: each rank's facts about each of its groups.

Readers (``readers/``) fill ``RankFacts`` from metrics, Prometheus or a job's files; the detectors
(``verdicts.detectors``) turn them into ``Finding``s; both write sets of ranks as ``ranges``.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable


END_WINDOW_S = 20.0
"""After the fact, shares of time in collectives are also taken over each rank's last this many seconds
of ops (``GroupFacts.waited_at_end_s``), as the rules' window."""


@dataclasses.dataclass
class GroupFacts:
    """What one rank shows of one process group."""

    issued: int = 0
    """The last collective sequence number it issued."""
    finished: int | None = None
    """The last collective sequence number it completed (live, or from the dump of a rank killed or told to
    stop; None: not known)."""
    hung: tuple[str, int] | None = None
    """(op, seq) of its oldest collective in flight past the hang threshold."""
    hung_bytes: int | None = None
    """The payload bytes of that collective (live)."""
    hung_lately: bool = False
    """Live: it waited past the hang threshold in this group (in a collective or a point-to-point op)
    within the window its waits are measured over (the window's waits are that one's, over or not)."""
    window_partial: bool = False
    """Live, from Prometheus: its numbers began within the window (a group whose first op came after
    the window began); the window's rates hold part of it, and the group's numbers are left unread."""
    p2p_hung: tuple[str, int, float] | None = None
    """(op, peer, seconds) of its oldest point-to-point op in flight past the hang threshold: it waits
    on the global rank ``peer`` (live)."""
    p2p_failed: tuple[str, int, int | None] | None = None
    """(op, peer, start ns or None live) of its first point-to-point op that failed: on the global rank
    ``peer``, whose process ended (gloo fails at once where NCCL hangs)."""
    failed: tuple[str, int] | None = None
    """(op, seq) of its first collective that failed (gloo fails at once where a peer's process ended)."""
    nonfinite: tuple[int, str, str] | None = None
    """(seq, op, kind) of the first collective whose input held NaN ("nan") or Inf ("inf")."""
    first_sends: dict[int, tuple[int, str]] = dataclasses.field(default_factory=dict)
    """peer (global rank) -> (its number among the sends to that peer, kind) of the first send to it whose
    input held NaN or Inf."""
    wait_s: float | None = None
    """Mean seconds per collective over the window (live)."""
    waited_s: float | None = None
    """Seconds per second spent in its collectives over the window (live; the same window for every
    rank), or over the rank's time from its first op to its last (after the fact)."""
    waited_at_end_s: float | None = None
    """After the fact: as ``waited_s``, over the rank's last ``END_WINDOW_S`` seconds of ops: the job's end
    as live would have seen it (a straggler that began mid-job is diluted over the whole); None live, or
    where its ops span under twice that."""
    completed: int = 0
    """Collectives that completed in the window (live)."""
    arrivals: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict)
    """seq -> (op, start ns) of each collective seen (offline)."""
    fingerprints: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict)
    """seq -> (op, fingerprint) of each fingerprinted collective's result (live: the last few; offline: from
    its spans): every member of the group holds the same, unless one's result was corrupted."""
    fingerprint_slots: dict[str, list] = dataclasses.field(default_factory=dict)
    """Live, while read: slot -> [seq, op, fingerprint] as its two metrics give them (``fingerprints``
    once both are read)."""
    scale_jumps: dict[int, tuple[int, int, float]] | None = None
    """seq -> (its DDP step, by how many binary orders its bucket's largest value grew over the bucket's
    recent scale, when it was issued: unix seconds) (``agent/scales.py``; live: the first jump of the
    latest burst, if within 5 min; offline: every jump, from its spans); None: no bucket of the group is
    followed so here."""
    scale_read: list = dataclasses.field(default_factory=lambda: [None] * 5)
    """Live, while read: [jumps, seq, step, orders, time] as its metrics give them (``scale_jumps`` once
    read)."""
    inputs: dict[int, tuple[str, str]] = dataclasses.field(default_factory=dict)
    """seq -> (op, its input tensors' dtypes and sizes) of each collective in its dumps (offline)."""
    hangs_seen: dict[int, tuple[int, int | None]] = dataclasses.field(default_factory=dict)
    """seq -> (start ns, end ns, None while in flight) of each collective it waited in past the hang
    threshold, resolved or not (offline)."""
    p2p_waits_seen: list[tuple[int, int | None, str, int]] = dataclasses.field(default_factory=list)
    """(start ns, end ns or None while in flight, op, peer) of each point-to-point op it waited in
    past the hang threshold (offline)."""
    threshold_s: float | None = None
    """The hang threshold, as the age at which its first hang was reported (offline)."""
    slow_waits: dict[int, tuple[str, int, int]] = dataclasses.field(default_factory=dict)
    """seq -> (op, start ns, end ns) of each collective it waited in long (a slow outlier: several
    times its usual), but under the hang threshold (offline)."""
    p2p_slow_waits: list[tuple[int, int, str, int]] = dataclasses.field(default_factory=list)
    """(start ns, end ns, op, peer) of each point-to-point op it waited in long (a slow outlier), but
    under the hang threshold, and that completed (offline)."""


@dataclasses.dataclass
class RankFacts:
    rank: int
    groups: dict[str, GroupFacts] = dataclasses.field(default_factory=dict)
    gone: bool = False
    """It no longer reports (its process ended or its endpoint is unreachable)."""
    lost: bool = False
    """Its process ended without a signal or an exception (killed, crashed), as a pod sidecar saw."""
    vanished: bool = False
    """It had no chance to say how its process ended — SIGKILL, the OOM killer, a crash — as its peers'
    waits on it or failures tell (``verdicts.detectors``): after the fact, it left neither a dump nor a note that it
    ended (``commlens.ring.dumps.ENDED``) where other ranks of its job left theirs; live (``--prometheus``),
    its own endpoint went down with no ``commlens_rank_up`` 0, signal or exception in its last scrapes."""
    stopped: bool = False
    """Its process was told to stop (SIGTERM), as its snapshots say (live); with ``gone``: it ended so, as
    a job torn down ends its ranks."""
    signalled_ns: int | None = None
    """When its process was signalled to stop (SIGTERM), wall-clock ns, from its dump (offline)."""
    started_ns: int | None = None
    """After the fact, when its first op of all began, a collective or point-to-point (ns, on the job's
    clock): before it, the job's start-up, which ranks reach at their own pace (importing, loading their
    data and checkpoints), the first to come waiting for the last."""
    waits: dict[int, int | None] = dataclasses.field(default_factory=dict)
    """start ns -> end ns (None while in flight) of every collective and point-to-point op it waited in
    long (slow) or past the hang threshold, in any group (offline; the span of a wait's end replaces the
    span it had in flight)."""
    entry: tuple[str, str, int, str, int] | None = None
    """(group, op, seq, kind, peer or -1) of its first input of all that held NaN or Inf (outside steps a
    loss scaler skipped)."""
    issued_before: dict[str, int] = dataclasses.field(default_factory=dict)
    """At its ``entry``: group -> the last collective it had issued in that group before it."""
    received_before: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)
    """At its ``entry``: (group, peer) -> the recvs from that peer it had issued in that group before it."""
    loss_scale_skipped: int = 0
    """Steps its loss scaler skipped for Inf or NaN in the gradients (offline: those seen in its spans)."""
    unobserved: str = ""
    """Why commlens did not start in it, where ``commlens run`` was told (offline): it ran unobserved."""
    node: str = ""
    """The node it runs on (``commlens_info``'s ``node``; live)."""
    unreachable: bool = False
    """Prometheus no longer reaches its metrics endpoint (``up == 0``; live, ``--prometheus``)."""
    aborted: bool = False
    """An op failed on it in the window (its ``abort`` snapshot: a peer's process or node went; live)."""
    least_waited: float | None = None
    """The least share of its time it spent in collectives, all groups, over the last 5 min (live,
    ``--prometheus``); now's is the sum of its groups' ``waited_s``."""

    def group(self, pg: str) -> GroupFacts:
        return self.groups.setdefault(pg, GroupFacts())


def ranges(ranks: Iterable[int]) -> str:
    """Sorted ranks as runs: ``ranges([0, 1, 2, 5])`` is ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
