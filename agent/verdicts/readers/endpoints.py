"""Ranks' facts from their metrics endpoints: two scrapes ``window_s`` apart, waits from what happened
between them.

Example::

    facts = from_endpoints(["http://node1:9464/metrics", "http://node1:9465/metrics"])
"""

from __future__ import annotations

import collections
import time
import urllib.parse
import urllib.request
from typing import Callable, Iterable

from commlens.exporters import names

from ..facts import RankFacts
from .common import say_skipped
from .metrics import DURATION_COUNT, DURATION_SUM, JUMPS_KEPT_S, metric_fact, settle


def from_metrics_texts(first: Iterable[str], second: Iterable[str], window_s: float) -> list[RankFacts]:
    """Facts from the Prometheus text of each rank's endpoint, as the ``first`` scrape found them, and
    the ``second`` taken ``window_s`` later: waits come from what happened between the two, and a rank
    that no longer answers is gone."""
    from prometheus_client.parser import text_string_to_metric_families

    ranks: dict[int, RankFacts] = {}
    totals: dict[tuple[int, str], list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    reporting: list[set[int]] = [set(), set()]
    down: set[int] = set()  # a pod sidecar's rank whose process has ended
    endings: dict[int, set[str]] = collections.defaultdict(set)  # snapshot reasons seen, by rank
    world_size = 0
    for index, texts in enumerate((first, second)):
        for text in texts:
            for s in (sample for family in text_string_to_metric_families(text) for sample in family.samples):
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
                    facts.node = s.labels.get("node", "")
                elif s.name == names.RANK_UP and s.value == 0:
                    down.add(rank)
                elif s.name == names.total(names.ABORT_SNAPSHOTS) and s.value > 0:
                    endings[rank].add(s.labels["reason"])
                elif index == 0:  # the state as first seen: a hang may resolve during the window
                    metric_fact(facts, s.name, s.labels, s.value)
                if s.name in (names.HUNG_SEQ, names.P2P_HUNG):
                    facts.group(pg).hung_lately = True
    for (rank, pg), (sum0, count0, sum1, count1) in totals.items():
        seconds, count = sum1 - sum0, count1 - count0
        if count > 0:
            ranks[rank].group(pg).wait_s = seconds / count
            ranks[rank].group(pg).waited_s = seconds / window_s
            ranks[rank].group(pg).completed = round(count)
    for rank in range(world_size):  # a rank no endpoint answered for
        ranks.setdefault(rank, RankFacts(rank))
    for rank, facts in ranks.items():
        settle(facts, rank not in reporting[1] or rank in down, endings[rank], time.time() - JUMPS_KEPT_S)
    return [ranks[rank] for rank in sorted(ranks)]


def from_endpoints(urls: list[str], window_s: float = 5.0, timeout_s: float = 5.0,
                   on_problem: Callable[[str], None] = say_skipped) -> list[RankFacts]:
    """Scrape each rank's metrics endpoint twice, ``window_s`` apart. An endpoint that does not
    answer is left out (its rank is then missing from every group), and ``on_problem`` gets one line
    naming it."""
    unanswered: set[str] = set()

    def scrape() -> list[str]:
        texts = []
        for url in urls:
            try:
                with urllib.request.urlopen(url, timeout=timeout_s) as response:
                    texts.append(response.read().decode())
            except (OSError, ValueError) as error:
                if url not in unanswered:
                    unanswered.add(url)
                    on_problem(f"the metrics endpoint {url}: {getattr(error, 'reason', None) or error}")
        return texts

    first = scrape()
    time.sleep(window_s)  # the window over which waits are measured
    return from_metrics_texts(first, scrape(), window_s)
