"""The verdict: which rank, which collective, why — from telemetry alone.

Facts about each rank come from one of three sources, always in the same shape (``RankFacts``):

* live, from the ranks' metrics endpoints (``from_endpoints``: two scrapes ``window_s`` apart);
* live, from a Prometheus server that scrapes them (``from_prometheus``);
* after the fact, from a job's trace files and flight-recorder dumps (``from_files``).

``findings()`` turns them into verdicts, the same way whatever the source; ``commlens diagnose``, the
demo's closing verdict and the alert rules (``deploy/prometheus-rules.yaml``, which compute the same
in PromQL) share this reasoning:

* **NaN/Inf origin** — the rank whose *input* held NaN or Inf at the lowest sequence number of its
  group: the values entered there; every rank they reached afterwards saw them later.
* **Lost rank** — a rank's process ended without a signal or an exception (SIGKILL, the OOM killer,
  a crash: the pod sidecar's ``exit`` snapshot with neither a ``signal`` nor an ``exception`` one)
  while its group hangs in or fails in a collective: that rank is the culprit, not the network.
* **Late or missing rank** — ranks wait past the hang threshold in collective ``seq``; the rank(s)
  that have not issued ``seq`` (or stopped reporting) are the culprits; the waiting ranks are evidence.
* **Desync** — at the same ``seq`` the ranks issued different ops: the minority issued the wrong one.
* **Straggler** — in a synchronous collective a rank waits for the last to arrive, so the time rank
  ``r`` spends in its collectives is ``(last arrival - r's arrival) + transfer``. The rank that waits
  least arrives last; how much less it waits than the group's longest waiter is how much later it
  arrives (no clock alignment needed). Offline, arrivals are read directly from span start times.
* **Hang** with no rank behind and no desync: every rank waits in the same collective.

Example::

    facts = from_endpoints(["http://node1:9464/metrics", "http://node1:9465/metrics"])
    for finding in findings(facts):
        print(finding.line())
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import pickle
import statistics
import sys
import time
import urllib.parse
import urllib.request
from typing import Callable, Iterable, Iterator

from commlens.exporters import names

DURATION_SUM, DURATION_COUNT = f"{names.COLLECTIVE_DURATION}_sum", f"{names.COLLECTIVE_DURATION}_count"

STRAGGLER_MIN_S = 0.005
"""A straggler arrives at least this much later, on average, than the group's first rank ..."""
STRAGGLER_RATIO = 0.5
"""... and waits less than this fraction of what the group's longest waiter waits (live) ..."""
STRAGGLER_EVIDENCE = 30
"""After the fact, a straggler is only named from at least this many collectives seen by every rank."""
STRAGGLER_LEAD = 1.5
"""... or, after the fact, arrives later on average than this many times the next latest rank (a rank
that waits on the straggler inherits part of its lateness: a broadcast's root, say)."""


@dataclasses.dataclass
class GroupFacts:
    """What one rank shows of one process group."""

    issued: int = 0
    """The last collective sequence number it issued."""
    hung: tuple[str, int] | None = None
    """(op, seq) of its oldest collective in flight past the hang threshold."""
    failed: tuple[str, int] | None = None
    """(op, seq) of its first collective that failed (gloo fails at once where a peer's process ended)."""
    nonfinite: tuple[int, str, str] | None = None
    """(seq, op, kind) of the first collective whose input held NaN ("nan") or Inf ("inf")."""
    wait_s: float | None = None
    """Mean seconds per collective over the window (live)."""
    arrivals: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict)
    """seq -> (op, start ns) of each collective seen (offline)."""
    hangs_seen: set[int] = dataclasses.field(default_factory=set)
    """Sequence numbers it waited on past the hang threshold, resolved or not (offline)."""
    threshold_s: float | None = None
    """The hang threshold, as the age at which its first hang was reported (offline)."""


@dataclasses.dataclass
class RankFacts:
    rank: int
    groups: dict[str, GroupFacts] = dataclasses.field(default_factory=dict)
    gone: bool = False
    """It no longer reports (its process ended or its endpoint is unreachable)."""
    lost: bool = False
    """Its process ended without a signal or an exception (killed, crashed), as a pod sidecar saw."""

    def group(self, pg: str) -> GroupFacts:
        return self.groups.setdefault(pg, GroupFacts())


@dataclasses.dataclass(frozen=True)
class Finding:
    kind: str
    """nan_origin, lost_rank, late_rank, desync, straggler or hang."""
    ranks: tuple[int, ...]
    pg: str
    op: str
    seq: int | None
    evidence: str

    def line(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {', '.join(map(str, self.ranks))}"
        where = f"{self.op} (group {self.pg}" + (f", seq {self.seq})" if self.seq is not None else ")")
        title = {"nan_origin": "NaN/Inf entered on", "lost_rank": "killed or crashed:", "late_rank": "late or missing:", "desync": "desync:",
                 "straggler": "straggler:", "hang": "hang: all waiting,"}[self.kind]
        return f"{title} {who} in {where} — {self.evidence}"


def findings(facts: Iterable[RankFacts]) -> list[Finding]:
    """Every verdict the facts support, most severe first; [] for a healthy job."""
    facts = list(facts)
    found: list[Finding] = []
    for pg in sorted({pg for f in facts for pg in f.groups}):
        members = [f for f in facts if pg in f.groups or pg == "0"]
        found += _nan_origin(pg, members)
        stuck = _hang(pg, members)
        if not any(f.kind == "desync" for f in stuck):
            stuck += _mismatch(pg, members)
        found += stuck
        if not stuck:
            found += _straggler(pg, members)
    order = ("nan_origin", "lost_rank", "desync", "late_rank", "hang", "straggler")
    return sorted(found, key=lambda f: order.index(f.kind))


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


def _hang(pg: str, members: list[RankFacts]) -> list[Finding]:
    """Late, missing and desynced ranks around the collective others hang in."""
    live = {f.rank: f.groups[pg].hung or f.groups[pg].failed for f in members
            if pg in f.groups and (f.groups[pg].hung or f.groups[pg].failed)}
    if live:
        seq = collections.Counter(s for _, s in live.values()).most_common(1)[0][0]
        ops = {rank: op for rank, (op, s) in live.items() if s == seq}
    else:  # after the fact: a hang that resolved, known from the spans of the ranks that waited
        waited = {s for f in members if pg in f.groups for s in f.groups[pg].hangs_seen}
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
    lost = sorted(f.rank for f in members if f.lost)
    if lost:
        others = [rank for rank in sorted(ops) if rank not in lost]
        own = [f.groups[pg] for f in members if f.rank == lost[0] and pg in f.groups]
        if own and 0 < own[0].issued <= seq:  # the collective it died in: its last (others may have finished it)
            majority = own[0].hung[0] if own[0].hung and own[0].hung[1] == own[0].issued else majority
            seq = own[0].issued
        return [Finding("lost_rank", tuple(lost), pg, majority, seq,
                        "its process ended without a signal or an exception (SIGKILL, the OOM killer, a crash)"
                        + (f"; ranks {others} waited in or failed in seq {seq}" if others else ""))]
    found = []
    wrong = sorted(rank for rank, op in ops.items() if op != majority)
    if wrong and count > len(wrong):
        found.append(_desync(pg, seq, {r: ops[r] for r in wrong}, waiting, majority))
    starts = [f.groups[pg].arrivals[seq][1] for f in members if f.rank in waiting and seq in f.groups[pg].arrivals]
    thresholds = [f.groups[pg].threshold_s for f in members if pg in f.groups and f.groups[pg].threshold_s]
    late = {f.rank: why for f in members if f.rank not in ops
            and (why := _late(f, pg, seq, bool(live), min(starts, default=None), min(thresholds, default=0.0)))
            is not None}
    if late:
        how = "failed in" if live and all(not f.groups[pg].hung for f in members if f.rank in ops) else \
            "waited past the hang threshold in"
        evidence = "; ".join([f"ranks {waiting} {how} {majority} seq {seq}",
                              *(f"rank {rank} {why}" for rank, why in sorted(late.items()))])
        found.append(Finding("late_rank", tuple(sorted(late)), pg, majority, seq, evidence))
    if not found and live:
        found.append(Finding("hang", tuple(waiting), pg, majority, seq,
                             f"ranks {waiting} wait in seq {seq} and no rank is behind: look at the network "
                             "or the backend"))
    return found


def _late(f: RankFacts, pg: str, seq: int, live: bool, first_wait_ns: int | None, threshold_s: float) -> str | None:
    """Why rank ``f`` is one the others waited for in ``seq``; None if it is not. After the fact, a
    rank is late when it issued ``seq`` once the first waiting rank had waited the hang threshold."""
    group = f.groups.get(pg)
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


def _desync(pg: str, seq: int, wrong: dict[int, str], others: list[int], op: str) -> Finding:
    theirs = ", ".join(sorted(set(wrong.values())))
    return Finding("desync", tuple(sorted(wrong)), pg, theirs, seq,
                   f"issued {theirs} at seq {seq} where ranks {others} issued {op}")


def _mismatch(pg: str, members: list[RankFacts]) -> list[Finding]:
    """After the fact: the first sequence number at which ranks issued different ops."""
    by_seq: dict[int, dict[int, str]] = collections.defaultdict(dict)
    for f in members:
        for seq, (op, _) in f.groups.get(pg, GroupFacts()).arrivals.items():
            by_seq[seq][f.rank] = op
    for seq in sorted(by_seq):
        ops = by_seq[seq]
        majority, count = collections.Counter(ops.values()).most_common(1)[0]
        wrong = {rank: op for rank, op in ops.items() if op != majority}
        if wrong and count > len(wrong):
            return [_desync(pg, seq, wrong, sorted(r for r, op in ops.items() if op == majority), majority)]
    return []


def _straggler(pg: str, members: list[RankFacts]) -> list[Finding]:
    groups = {f.rank: f.groups[pg] for f in members if pg in f.groups and not f.gone}
    if len(groups) < 2:
        return []
    waits = {rank: g.wait_s for rank, g in groups.items() if g.wait_s is not None}
    if len(waits) == len(groups):  # live: lateness from waits
        longest = max(waits.values())
        rank = min(waits, key=waits.get)
        lateness = longest - waits[rank]
        if lateness > STRAGGLER_MIN_S and waits[rank] < STRAGGLER_RATIO * longest:
            return [Finding("straggler", (rank,), pg, "all", None,
                            f"it waits {waits[rank] * 1e3:.1f} ms per collective where the group's longest waiter "
                            f"waits {longest * 1e3:.1f} ms: it arrives about {lateness * 1e3:.1f} ms after the others")]
        return []
    common = set.intersection(*(set(g.arrivals) for g in groups.values()))
    if len(common) < STRAGGLER_EVIDENCE:  # too few collectives seen by every rank to tell
        return []
    late: dict[int, list[float]] = collections.defaultdict(list)
    last = collections.Counter()
    for seq in common:  # per collective: how long after the first rank each rank arrived
        starts = {rank: g.arrivals[seq][1] for rank, g in groups.items()}
        first = min(starts.values())
        for rank, start in starts.items():
            late[rank].append((start - first) / 1e9)
        last[max(starts, key=starts.get)] += 1
    mean = {rank: _trimmed_mean(values) for rank, values in late.items()}
    rank, *others = sorted(mean, key=mean.get, reverse=True)
    runner_up = max((mean[r] for r in others), default=0.0)
    if mean[rank] > STRAGGLER_MIN_S and mean[rank] > STRAGGLER_LEAD * runner_up:
        return [Finding("straggler", (rank,), pg, "all", None,
                        f"over {len(common)} collectives it arrived on average {mean[rank] * 1e3:.1f} ms after the "
                        f"first rank (the next latest rank: {runner_up * 1e3:.1f} ms), last in {last[rank]}")]
    return []


def _trimmed_mean(values: list[float]) -> float:
    """The mean without the highest and lowest tenth: a warm-up step's spikes do not make a straggler."""
    values = sorted(values)
    cut = len(values) // 10
    return statistics.fmean(values[cut:len(values) - cut])


# -- sources: metrics endpoints ---------------------------------------------------------------------


def from_metrics_texts(first: Iterable[str], second: Iterable[str] | None = None) -> list[RankFacts]:
    """Facts from the Prometheus text of each rank's endpoint, as the ``first`` scrape found them; with
    a ``second`` scrape of each, taken later, waits come from what happened between the two (else
    from the whole run), and a rank that no longer answers is gone."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples(text: str):
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    ranks: dict[int, RankFacts] = {}
    totals: dict[tuple[int, str], list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    reporting: list[set[int]] = [set(), set()]
    down: set[int] = set()  # a pod sidecar's rank whose process has ended
    endings: dict[int, set[str]] = collections.defaultdict(set)  # snapshot reasons seen, by rank
    world_size = 0
    for index, texts in enumerate((first, second or ())):
        for text in texts:
            for s in samples(text):
                rank = int(s.labels.get("rank", -1))
                if rank < 0:
                    continue
                reporting[index].add(rank)
                facts = ranks.setdefault(rank, RankFacts(rank))
                pg = s.labels.get("pg")
                if s.name == DURATION_SUM:
                    totals[(rank, pg)][2 * index] += s.value
                elif s.name == DURATION_COUNT:
                    totals[(rank, pg)][2 * index + 1] += s.value
                elif s.name == names.INFO:
                    world_size = max(world_size, int(s.labels.get("world_size", 0)))
                elif s.name == names.RANK_UP and s.value == 0:
                    down.add(rank)
                elif s.name == names.total(names.ABORT_SNAPSHOTS) and s.value > 0:
                    endings[rank].add(s.labels["reason"])
                elif index == 0:  # the state as first seen: a hang may resolve during the window
                    _metric_fact(facts, s.name, s.labels, s.value)
    for (rank, pg), (sum0, count0, sum1, count1) in totals.items():
        seconds, count = (sum1 - sum0, count1 - count0) if second is not None else (sum0, count0)
        if count > 0:
            ranks[rank].group(pg).wait_s = seconds / count
    for rank in range(world_size):  # a rank no endpoint answered for
        ranks.setdefault(rank, RankFacts(rank))
    for rank, facts in ranks.items():
        facts.gone = rank not in reporting[1 if second is not None else 0] or rank in down
        facts.lost = _lost(endings[rank])
    return [ranks[rank] for rank in sorted(ranks)]


def _metric_fact(facts: RankFacts, name: str, labels: dict, value: float) -> None:
    pg = labels.get("pg")
    if name == names.LAST_SEQ and labels.get("state") == "enqueued":
        facts.group(pg).issued = int(value)
    elif name == names.HUNG_SEQ:
        facts.group(pg).hung = (labels["op"], int(value))
    elif name == names.FAILED_SEQ:
        facts.group(pg).failed = (labels["op"], int(value))
    elif name == names.NONFINITE_FIRST_SEQ:
        group = facts.group(pg)
        if group.nonfinite is None or value < group.nonfinite[0]:
            group.nonfinite = (int(value), labels["op"], labels["kind"])


def _lost(reasons: set[str]) -> bool:
    """Snapshot reasons of a rank that ended without a signal or an exception."""
    return "exit" in reasons and not reasons & {"signal", "exception"}


def from_endpoints(urls: list[str], window_s: float = 5.0, timeout_s: float = 5.0) -> list[RankFacts]:
    """Scrape each rank's metrics endpoint twice, ``window_s`` apart. An endpoint that does not
    answer is left out (its rank is then missing from every group)."""
    def scrape() -> list[str]:
        texts = []
        for url in urls:
            try:
                with urllib.request.urlopen(url, timeout=timeout_s) as response:
                    texts.append(response.read().decode())
            except OSError:
                continue
        return texts

    first = scrape()
    time.sleep(window_s)  # the window over which waits are measured
    return from_metrics_texts(first, scrape())


# -- sources: Prometheus ----------------------------------------------------------------------------


def from_prometheus(url: str, job: str | None = None, window: str = "15s") -> dict[str, list[RankFacts]]:
    """Facts for each job Prometheus knows (or only ``job``), from instant queries of its HTTP API."""
    selector = f'job="{job}"' if job else ""

    def query(expr: str) -> list[dict]:
        address = url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(address, timeout=10) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus at {url} refused {expr!r}: {body.get('error')}")
        return body["data"]["result"]

    jobs: dict[str, dict[int, RankFacts]] = collections.defaultdict(dict)

    def each(expr: str):
        for item in query(expr):
            labels, value = item["metric"], float(item["value"][1])
            facts = jobs[labels.get("job", "")].setdefault(int(labels["rank"]), RankFacts(int(labels["rank"])))
            yield facts, labels, value

    enqueued = f'{names.LAST_SEQ}{{state="enqueued"{"," + selector if selector else ""}}}'
    hung = f"{names.HUNG_SEQ}{{{selector}}}"
    for facts, labels, value in each(f"last_over_time({enqueued}[15m])"):
        facts.group(labels["pg"]).issued = int(value)
    # while a group had a hang in the last minute: what each rank had issued (a late rank may have
    # caught up since), and the hang itself
    for facts, labels, value in each(f"min_over_time(({enqueued} and on (job, pg) {hung})[1m:1s])"):
        facts.group(labels["pg"]).issued = int(value)
    live = {(labels.get("job", ""), int(labels["rank"])) for _, labels, _ in each(enqueued)}
    for name, expr in ((names.HUNG_SEQ, f"max_over_time({hung}[1m])"),
                       (names.NONFINITE_FIRST_SEQ, f"{names.NONFINITE_FIRST_SEQ}{{{selector}}}"),
                       (names.FAILED_SEQ, f"last_over_time({names.FAILED_SEQ}{{{selector}}}[5m])")):
        for facts, labels, value in each(expr):
            _metric_fact(facts, name, labels, value)
    by = "sum by (job, pg, rank)"
    for facts, labels, value in each(f"{by} (rate({DURATION_SUM}{{{selector}}}[{window}])) / "
                                     f"{by} (rate({DURATION_COUNT}{{{selector}}}[{window}]))"):
        facts.group(labels["pg"]).wait_s = value
    down = {(labels.get("job", ""), int(labels["rank"])) for _, labels, _ in each(f"{names.RANK_UP}{{{selector}}} == 0")}
    endings: dict[tuple[str, int], set[str]] = collections.defaultdict(set)
    for _, labels, _ in each(f"{names.total(names.ABORT_SNAPSHOTS)}{{{selector}}} > 0"):
        endings[(labels.get("job", ""), int(labels["rank"]))].add(labels["reason"])
    for name, ranks in jobs.items():
        for rank, facts in ranks.items():
            facts.gone = (name, rank) not in live or (name, rank) in down
            facts.lost = _lost(endings[(name, rank)])
    return {name: [ranks[r] for r in sorted(ranks)] for name, ranks in jobs.items()}


# -- sources: trace files and dumps -----------------------------------------------------------------


class _PlainUnpickler(pickle.Unpickler):
    """Admits plain containers and scalars only: reading a dump never runs code."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refused {module}.{name}: a flight-recorder dump holds plain data only")


def load_dump(path: str) -> dict:
    """A flight-recorder dump, read without running code; a clear error for anything else."""
    with open(path, "rb") as f:
        try:
            data = _PlainUnpickler(f).load()
        except Exception as error:
            raise ValueError(f"{path} is not a flight-recorder dump: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path} is not a flight-recorder dump: no list of entries")
    return data


def from_files(folder: str, each_span: Callable[[dict, dict], None] | None = None) -> list[RankFacts]:
    """Facts from the OTLP JSON-lines trace files (``*.jsonl``) and flight-recorder dumps in ``folder``;
    ``each_span(span, attributes)`` sees every span as it is read, for a caller that needs them too."""
    ranks: dict[int, RankFacts] = {}
    completed: set[tuple[int, str, int]] = set()
    for span, attributes in spans_in(folder):
        _span_fact(ranks, span, attributes, completed)
        if each_span is not None:
            each_span(span, attributes)
    for f in ranks.values():  # a hang that the spans show resolved is no longer in flight
        for pg, group in f.groups.items():
            if group.hung is not None and (f.rank, pg, group.hung[1]) in completed:
                group.hung = None
    for path in sorted(glob.glob(os.path.join(folder, "*"))):
        digits = len(path) - len(path.rstrip("0123456789"))
        if not digits or os.path.isdir(path) or path.endswith((".json", ".jsonl")):
            continue
        try:
            dump = load_dump(path)
        except ValueError:
            continue
        _dump_fact(ranks.setdefault(int(path[-digits:]), RankFacts(int(path[-digits:]))), dump)
    return [ranks[rank] for rank in sorted(ranks)]


def spans_in(folder: str) -> Iterator[tuple[dict, dict]]:
    """Every span of the OTLP JSON-lines trace files (``*.jsonl``) in ``folder``, with its attributes."""
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                for resource_spans in json.loads(line).get("resourceSpans", ()):
                    for scope_spans in resource_spans.get("scopeSpans", ()):
                        for span in scope_spans.get("spans", ()):
                            yield span, {item["key"]: _value(item) for item in span.get("attributes", ())}


def _value(attribute: dict):
    value = attribute["value"]
    for key in ("intValue", "doubleValue", "boolValue", "stringValue"):
        if key in value:
            return int(value[key]) if key == "intValue" else value[key]
    return None


def _span_fact(ranks: dict[int, RankFacts], span: dict, a: dict, completed: set[tuple[int, str, int]]) -> None:
    if a.get(names.P2P) or names.RANK not in a:
        return
    rank, seq, op, pg = int(a[names.RANK]), int(a[names.SEQ]), a[names.OP], str(a[names.PG_NAME])
    group = ranks.setdefault(rank, RankFacts(rank)).group(pg)
    if not a.get(names.IN_FLIGHT):
        completed.add((rank, pg, seq))
        if a.get(names.STATUS) in ("error", "timeout") and (group.failed is None or seq < group.failed[1]):
            group.failed = (op, seq)
    group.arrivals[seq] = (op, int(span["startTimeUnixNano"]))
    group.issued = max(group.issued, seq)
    if a.get(names.HANG):
        group.hangs_seen.add(seq)
        if a.get(names.IN_FLIGHT):
            group.hung = (op, seq)
            age = float(a.get(names.AGE_S, 0.0))
            group.threshold_s = age if group.threshold_s is None else min(group.threshold_s, age)
    for kind in ("nan", "inf"):
        if a.get(f"commlens.{kind}") and (group.nonfinite is None or seq < group.nonfinite[0]):
            group.nonfinite = (seq, op, kind)


def _dump_fact(facts: RankFacts, dump: dict) -> None:
    for entry in dump["entries"]:
        if entry.get("is_p2p"):
            continue
        group = facts.group(str(entry["process_group"][0]))
        group.issued = max(group.issued, int(entry["collective_seq_id"]))


def main(argv: list[str] | None = None) -> int:
    """``commlens diagnose``: print the verdict; exit status 0 when nothing is wrong, 1 otherwise."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="commlens diagnose", description="Name the rank, collective and cause of what went wrong in a job.",
        epilog="Examples: commlens diagnose ./commlens-out   |   commlens diagnose --metrics "
        "http://node1:9464/metrics http://node1:9465/metrics   |   commlens diagnose --prometheus http://prom:9090 --job train-42")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("folder", nargs="?", help="a job's trace files (*.jsonl) and flight-recorder dumps")
    source.add_argument("--metrics", nargs="+", metavar="URL", help="the ranks' metrics endpoints, live")
    source.add_argument("--prometheus", metavar="URL", help="a Prometheus server that scrapes the ranks, live")
    parser.add_argument("--job", help="with --prometheus: the job label to look at (default: every job)")
    parser.add_argument("--window", type=float, default=5.0,
                        help="with --metrics: seconds between the two scrapes that waits are measured over")
    args = parser.parse_args(argv)
    if args.folder is not None and not os.path.isdir(args.folder):
        parser.error(f"{args.folder!r} is not a folder: give the folder of a job's trace files and dumps")
    try:
        if args.prometheus:
            jobs = from_prometheus(args.prometheus, args.job)
        else:
            jobs = {"": from_endpoints(args.metrics, args.window) if args.metrics else from_files(args.folder)}
    except OSError as error:
        print(f"commlens diagnose: cannot read the telemetry: {error}", file=sys.stderr)
        return 2
    wrong = False
    for job, facts in sorted(jobs.items()):
        lines = report(facts)
        wrong = wrong or lines != [NOTHING_WRONG]
        for line in lines:
            print(f"{job}: {line}" if job else line)
    if not jobs:
        print("no commlens telemetry found")
    return 1 if wrong else 0


NOTHING_WRONG = "nothing wrong found"


def report(facts: list[RankFacts]) -> list[str]:
    """The verdict as lines: one per finding, or ``NOTHING_WRONG``."""
    return [finding.line() for finding in findings(facts)] or [NOTHING_WRONG]
