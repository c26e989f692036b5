"""Ranks' facts from Prometheus (or VictoriaMetrics): instant queries of its HTTP API over windows of
4 of its scrapes or more, each attempt of a restarted job apart.

Example::

    jobs = from_prometheus("http://prometheus:9090")     # job -> its ranks' facts
    jobs = from_prometheus("http://vm:8428", "train-42", timeout_s=60)   # one job; a slow store
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import re
import statistics
import time
import urllib.parse
import urllib.request

from commlens.exporters import names

from ..facts import RankFacts
from ..rule_files import window_s
from .metrics import DURATION_COUNT, DURATION_SUM, metric_fact, settle


QUERY_TIMEOUT_S = 10.0
"""How long a query is waited for, unless told (``commlens diagnose --query-timeout``)."""


@dataclasses.dataclass(frozen=True)
class _Api:
    """The HTTP API of a Prometheus (or VictoriaMetrics) at ``url``; a request not answered within
    ``timeout_s`` raises ``TimeoutError``."""

    url: str
    timeout_s: float

    def query(self, expr: str, at: float) -> list[dict]:
        """An instant query's result at ``at`` (a Unix time)."""
        body = self.get("query", query=expr, time=repr(at))
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus at {self.url} refused {expr!r}: {body.get('error')}")
        return body["data"]["result"]

    def get(self, path: str, **params: str) -> dict:
        """The JSON of ``/api/v1/<path>?<params>``."""
        address = f"{self.url.rstrip('/')}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(address, timeout=self.timeout_s) as response:
            return json.load(response)


def from_prometheus(url: str, job: str | None = None, timeout_s: float = QUERY_TIMEOUT_S) -> dict[str, list[RankFacts]]:
    """Facts for each job Prometheus knows (or only ``job``), from instant queries of its HTTP API; their
    windows hold 4 of its scrapes or more (``scrape_interval_s``). A job that torchrun restarted (its
    ranks' ``commlens_info`` of more than one ``attempt`` in the last 15 min) gives facts for each
    attempt, keyed "<job>, attempt <N>": each read as the next one began (its ranks' ends all scraped),
    over windows that begin with it, once every rank has begun it (the attempts' collectives are
    numbered alike, their counters start again). Each query is given ``timeout_s``, and every one is
    evaluated at the instant the reading began: a live reading is one moment's state however long its
    queries take (a loaded store answering over seconds while the job's ranks fail)."""
    api, now = _Api(url, timeout_s), time.time()
    selector = f'job="{job}"' if job else ""
    interval = _scrape_interval_s(api, job)
    began: dict[str, dict[int, float]] = collections.defaultdict(dict)
    """Each job's attempts in the last 15 min, with each one's first scrape (over its ranks)."""
    everyone_in: dict[str, dict[int, float]] = collections.defaultdict(dict)
    """The same, with the first scrape of the attempt's last rank to begin it: until then a rank of
    the attempt before may still show that attempt's numbers (a pod sidecar's rank still being torn down)."""
    firsts = f"min_over_time(timestamp({names.INFO}{{{selector}}})[15m:{interval}s])"
    for by, into in (("min", began), ("max", everyone_in)):
        for item in api.query(f"{by} by (job, attempt) ({firsts})", now):
            into[item["metric"].get("job", "")][int(item["metric"].get("attempt", "0"))] = float(item["value"][1])
    restarted = {name: sorted(attempts.items()) for name, attempts in began.items() if len(attempts) > 1}
    found = _prometheus_facts(api, selector, interval, now) if not began or began.keys() - restarted.keys() else {}
    for name, attempts in restarted.items():
        found.pop(name, None)
        for (attempt, first), after in itertools.zip_longest(attempts, attempts[1:]):
            at = now if after is None else after[1] - 0.001  # as the next began: its ranks' ends all scraped
            since = first if attempt == attempts[0][0] else everyone_in[name][attempt]
            facts = _prometheus_facts(api, f'job="{name}"', interval, at, since).get(name, [])
            if facts:
                found[f"{name}, attempt {attempt}"] = facts
    return found


def _prometheus_facts(api: _Api, selector: str, interval: int, at: float,
                      since: float | None = None) -> dict[str, list[RankFacts]]:
    """Each job's facts as of ``at`` (a Unix time), over windows that begin no earlier than ``since``."""

    def span(seconds: float) -> str:  # a window of ``seconds``, cut at ``since`` (whose scrape it keeps)
        if since is None or seconds <= at - since:
            return f"{int(seconds)}s"
        return f"{max(1, math.ceil((at - since) * 1000) + 1)}ms"

    window, lookback = span(window_s(10, interval)), span(window_s(60, interval))  # the arrival rules' windows
    last_15m, last_5m = span(900), span(300)

    def query(expr: str) -> list[dict]:
        return api.query(expr, at)

    jobs: dict[str, dict[int, RankFacts]] = collections.defaultdict(dict)

    def each(expr: str):
        for item in query(expr):
            labels, value = item["metric"], float(item["value"][1])
            facts = jobs[labels.get("job", "")].setdefault(int(labels["rank"]), RankFacts(int(labels["rank"])))
            yield facts, labels, value

    enqueued = f'{names.LAST_SEQ}{{state="enqueued"{"," + selector if selector else ""}}}'
    completed = f'{names.LAST_SEQ}{{state="completed"{"," + selector if selector else ""}}}'
    hung, failed = f"{names.HUNG_SEQ}{{{selector}}}", f"{names.FAILED_SEQ}{{{selector}}}"
    jumps = names.total(names.INPUT_SCALE_JUMPS)
    # the last issued and completed (by their state label); then, while a group had a hang in the last
    # minute: what each rank had issued (a late rank may have caught up since), and the hang itself
    for name, expr in ((names.LAST_SEQ, f"last_over_time({enqueued}[{last_15m}])"),
                       (names.LAST_SEQ, f"last_over_time({completed}[{last_15m}])"),
                       (names.LAST_SEQ, f"min_over_time(({enqueued} and on (job, pg) {hung})[{lookback}:1s])"),
                       # a hang in the last minute; or as long as a failure is kept, one its op's failure ended
                       (names.HUNG_SEQ, f"max_over_time({hung}[{lookback}]) or (max_over_time({hung}[{last_5m}]) "
                                        f"and on (job, pg, rank) last_over_time({failed}[{last_5m}]))"),
                       (names.HUNG_BYTES, f"last_over_time({names.HUNG_BYTES}{{{selector}}}[{lookback}])"),
                       (names.P2P_HUNG, f"{names.P2P_HUNG}{{{selector}}}"),
                       *((name, f"{name}{{{selector}}}") for name in (
                           names.NONFINITE_FIRST_SEQ, names.NONFINITE_FIRST_SEND, names.NONFINITE_ENTRY_SEQ,
                           names.NONFINITE_ISSUED_BEFORE, names.REPLICA_FINGERPRINT, names.REPLICA_FINGERPRINT_SEQ)),
                       (names.total(names.LOSS_SCALE_STEPS), f"{names.total(names.LOSS_SCALE_STEPS)}{{{selector}}}"),
                       # the jumps of a group's buckets' scale while recent (as the rules judge), the last's
                       (jumps, f"last_over_time({jumps}{{{selector}}}[{last_5m}]) and on (job, pg, rank) "
                               f"({_jumped_lately(selector, last_5m)})"),
                       *((name, f"last_over_time({name}{{{selector}}}[{last_5m}])") for name in (
                           names.INPUT_SCALE_JUMP_SEQ, names.INPUT_SCALE_JUMP_STEP, names.INPUT_SCALE_JUMP_ORDERS,
                           names.INPUT_SCALE_JUMP_TIME)),
                       (names.FAILED_SEQ, f"last_over_time({failed}[{last_5m}])"),
                       (names.P2P_FAILED, f"last_over_time({names.P2P_FAILED}{{{selector}}}[{last_5m}])")):
        for facts, labels, value in each(expr):
            metric_fact(facts, name, labels, value)
    by = "sum by (job, pg, rank)"
    # a group's numbers only over a full window: its series there as the window began (as the rules'
    # 10 s records); a window that began before them holds a part of it, scaled to the whole
    full = f"and on (job, pg, rank) {DURATION_COUNT}{{{selector}}} offset {window}"
    for facts, labels, value in each(f"{by} (rate({DURATION_SUM}{{{selector}}}[{window}])) / "
                                     f"{by} (rate({DURATION_COUNT}{{{selector}}}[{window}])) {full}"):
        facts.group(labels["pg"]).wait_s = value
    for facts, labels, value in each(f"{by} (rate({DURATION_SUM}{{{selector}}}[{window}])) {full}"):
        facts.group(labels["pg"]).waited_s = value
    for facts, labels, value in each(f"{by} (increase({DURATION_COUNT}{{{selector}}}[{window}])) {full}"):
        facts.group(labels["pg"]).completed = round(value)
    for facts, labels, _ in each(f"count by (job, pg, rank) ({DURATION_COUNT}{{{selector}}}) unless on (job, pg, rank) "
                                 f"{DURATION_COUNT}{{{selector}}} offset {window}"):
        facts.group(labels["pg"]).window_partial = True
    p2p_hung = f"{names.P2P_HUNG}{{{selector}}}"
    for facts, labels, _ in each(f"max_over_time({hung}[{window}]) or max_over_time({p2p_hung}[{window}])"):
        facts.group(labels["pg"]).hung_lately = True
    for facts, labels, value in each(f"min_over_time((sum by (job, rank) (rate({DURATION_SUM}{{{selector}}}"
                                     f"[{window}])) and on (job, rank) {DURATION_COUNT}{{{selector}}} offset "
                                     f"{window})[{last_5m}:5s])"):
        facts.least_waited = value
    info = f"last_over_time({names.INFO}{{{selector}}}[{last_15m}])"
    for facts, labels, _ in each(info):
        facts.node = labels.get("node", "")
    # down for 2 scrapes at least: one missed is an endpoint too busy to answer in time (CommlensRankKilled's `for`)
    for facts, _, _ in each(f"{info} and on (job, instance) (max_over_time(up[{int(2500 * interval)}ms]) == 0)"):
        facts.unreachable = True
    aborts = f'{names.total(names.ABORT_SNAPSHOTS)}{{reason="abort"{"," + selector if selector else ""}}}'
    for facts, _, _ in each(f"increase({aborts}[{last_5m}]) > 0"):
        facts.aborted = True
    said_up = {(labels.get("job", ""), int(labels["rank"])) for _, labels, _ in each(
        f"last_over_time({names.RANK_UP}{{{selector}}}[{last_15m}])")}
    live = {(labels.get("job", ""), int(labels["rank"])) for _, labels, _ in each(enqueued)}
    down = {(labels.get("job", ""), int(labels["rank"])) for _, labels, _ in each(f"{names.RANK_UP}{{{selector}}} == 0")}
    endings: dict[tuple[str, int], set[str]] = collections.defaultdict(set)
    # over the job: a pod sidecar's counts end with it, and a killed rank stays the evidence after
    for _, labels, _ in each(f"max_over_time({names.total(names.ABORT_SNAPSHOTS)}{{{selector}}}[{last_15m}]) > 0"):
        endings[(labels.get("job", ""), int(labels["rank"]))].add(labels["reason"])
    for name, ranks in jobs.items():
        for rank, facts in ranks.items():
            settle(facts, (name, rank) not in live or (name, rank) in down, endings[(name, rank)])
            # its own endpoint gone without a word of how it ended (an in-process agent's; docs/verdicts.md)
            facts.vanished = facts.unreachable and (name, rank) not in said_up and not endings[(name, rank)] & {
                "signal", "exception", "exit"}
    return {name: [ranks[r] for r in sorted(ranks)] for name, ranks in jobs.items()}


def _jumped_lately(selector: str, window: str) -> str:
    """The ranks' groups whose buckets' last jump in scale, if any, is within ``window``, by Prometheus'
    clock (as ``commlens:input_scale_first_jump``): its time changed there, or its series began there."""
    time = f"{names.INPUT_SCALE_JUMP_TIME}{{{selector}}}"
    return f"changes({time}[{window}]) > 0 or last_over_time({time}[{window}]) unless {time} offset {window}"


def scrape_interval_s(url: str, job: str | None = None) -> int:
    """The longest scrape interval of the active targets (of ``job``), in seconds, as Prometheus' targets
    API says; where it says nothing (VictoriaMetrics fed by vmagents, a query front-end), the spacing of
    ``up``'s samples over the last 5 min; 1 where neither does."""
    return _scrape_interval_s(_Api(url, QUERY_TIMEOUT_S), job)


def _scrape_interval_s(api: _Api, job: str | None) -> int:
    return max(_targets_intervals(api, job) or _up_spacings(api, job), default=1) or 1


def _targets_intervals(api: _Api, job: str | None) -> list[int]:
    try:
        targets = api.get("targets", state="active")["data"]["activeTargets"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [sum(int(n) * {"h": 3600, "m": 60, "s": 1}[unit] for n, unit in re.findall(r"(\d+)([hms])(?!s)",
                                                                                    target.get("scrapeInterval", "")))
            for target in targets if not job or target.get("labels", {}).get("job") == job]


def _up_spacings(api: _Api, job: str | None) -> list[int]:
    """The median spacing of each target's ``up`` samples (a scrape writes one) over the last 5 min."""
    selector = f'{{job="{job}"}}' if job else ""
    try:
        series = api.get("query", query=f"up{selector}[5m]")["data"]["result"]
        stamps = [[float(t) for t, _ in s["values"]] for s in series]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [round(statistics.median(b - a for a, b in zip(t, t[1:]))) for t in stamps if len(t) > 1]
