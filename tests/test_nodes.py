"""A job across nodes: 3 nodes of 2 ranks (network namespaces, ``tests/nodes.py``), each under
``commlens run --sidecar -- torchrun`` with its own pod sidecar, Debian's Prometheus scraping every node
with the shipped rules, Alertmanager delivering to a webhook. ``tests/parallel_train.py``: each node's
two ranks a tensor-parallel pair, a pipeline across the nodes, DDP over them, the job's loss over all.

Needs root; skipped without it, except in CI (``CI`` set), where a missing harness is a failure."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import time

import pytest

from commlens.agent.verdicts import findings
from commlens.agent.verdicts.catalogue import VERDICT_ALERTS
from commlens.agent.verdicts.facts import RankFacts
from commlens.exporters import names
from monitoring import PARALLEL_SCRIPT, STARTUP_S, Alertmanager, Prometheus, Webhook, wait_for
from nodes import Nodes, NodeJob, why_not
from receivers import GrpcReceiver, span_attributes, spans_of

RULES = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "prometheus-rules.yaml"
CULPRIT_ALERTS = VERDICT_ALERTS


@pytest.fixture
def harness():
    reason = why_not()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the multi-node harness cannot run in CI: {reason}")
        pytest.skip(reason)


@contextlib.contextmanager
def _cluster(tmp_path, steps: int, spans: bool = False):
    """The 3 nodes' job, Prometheus and Alertmanager; with ``spans``, an OTLP/gRPC receiver on the host
    that every node's pod sidecar sends its spans to (else each writes files), yielded last."""
    with Nodes(3) as nodes, Webhook() as webhook, Alertmanager(tmp_path, webhook.url) as alertmanager, \
            contextlib.ExitStack() as stack:
        receiver = GrpcReceiver(host=nodes.gateway) if spans else None
        if receiver is not None:
            stack.callback(receiver.close)
        job = NodeJob(nodes, tmp_path / "job", PARALLEL_SCRIPT,
                      ["--steps", str(steps), "--step-ms", "20", "--timeout-s", "30"],
                      spans_to=receiver and receiver.endpoint, env={"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
        with Prometheus(tmp_path, job, [RULES], alertmanager.address) as prometheus:
            wait_for(lambda: len(prometheus.query("commlens_info")) == 6, "every rank of the 3 nodes scraped",
                     STARTUP_S, explain=lambda: _logs(job))
            yield nodes, job, webhook, prometheus, receiver


def _judged(prometheus: Prometheus) -> None:
    """Until the rules judge every rank: 10 s of its collectives scraped (its windows full), its healthy
    share of time in collectives recorded to compare with."""
    wait_for(lambda: len(prometheus.query("commlens:collective_wait_seconds:rate10s")) == 6,
             "every rank's share of its time in collectives over a full window")


def _logs(job: NodeJob) -> str:
    return " | ".join(f"node {k}: {(job.out / f'node-{k}.log').read_text()[-1500:]}" for k in range(3))


def _diagnose(*args) -> str:
    done = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", *args], capture_output=True,
                          text=True, timeout=60)
    return done.stdout + done.stderr


@pytest.mark.across_nodes
@pytest.mark.parametrize("fault", ["kill", "cut"])
def test_a_node_killed_or_cut_off_is_named_by_the_alert_and_diagnose_and_nothing_else_is(tmp_path, harness, fault):
    """Node 1 (ranks 2 and 3) vanishes mid-training: every process on it SIGKILLed (a host gone), or its
    link cut (the ranks alive, unreachable). Ranks of the other nodes fail or hang in collectives and
    receives that involve it, and torchrun ends them. The alert names node 1, not ranks 2 and 3 one by
    one, nor the ranks held up by it, nor the nodes torn down after it; ``commlens diagnose
    --prometheus`` says the same. About 40 s."""
    with _cluster(tmp_path, steps=3000) as (nodes, job, webhook, prometheus, _):
        wait_for(lambda: prometheus.query('commlens_collective_last_seq{pg="0", state="completed"} > 2'),
                 "the job's loss all_reduced a few times")
        nodes.kill(1) if fault == "kill" else nodes.cut(1)
        wait_for(lambda: webhook.firing("CommlensNodeUnreachable"), "CommlensNodeUnreachable at the webhook",
                 explain=lambda: f"{webhook.alerts} {_logs(job)}")
        live = _diagnose("--prometheus", f"http://127.0.0.1:{prometheus.port}")
        named = {(a["labels"]["alertname"], a["labels"].get("node"), a["labels"].get("rank"))
                 for a in webhook.alerts if a["labels"]["alertname"] in CULPRIT_ALERTS}
    assert named == {("CommlensNodeUnreachable", "node-1", None)}, webhook.alerts
    verdicts = [line for line in live.splitlines() if " — " in line]  # one per finding, after the job's name
    assert len(verdicts) == 1 and ": unreachable: node node-1 (ranks 2, 3) in " in verdicts[0], live


@pytest.mark.across_nodes
def test_a_node_throttled_to_a_tenth_of_a_cpu_is_named_slow_and_nothing_else_is(tmp_path, harness):
    """Node 1's processes (its two ranks, its pod sidecar) get a tenth of one CPU mid-training, once the
    rules judge every rank: its ranks arrive last where they meet the other nodes, and compute while
    those wait. ``CommlensNodeSlow`` names node 1, no alert names anyone else, and ``commlens diagnose
    --prometheus`` prints that one verdict. About 60 s."""
    with _cluster(tmp_path, steps=3000) as (nodes, job, webhook, prometheus, _):
        _judged(prometheus)
        nodes.throttle(1, 0.1)
        wait_for(lambda: webhook.firing("CommlensNodeSlow"), "CommlensNodeSlow at the webhook", timeout_s=60,
                 explain=lambda: f"{webhook.alerts} {_logs(job)}")
        live = _diagnose("--prometheus", f"http://127.0.0.1:{prometheus.port}")
        named = {(a["labels"]["alertname"], a["labels"].get("node"), a["labels"].get("rank"))
                 for a in webhook.alerts if a["labels"]["alertname"] in CULPRIT_ALERTS}
    assert named == {("CommlensNodeSlow", "node-1", None)}, webhook.alerts
    verdicts = [line for line in live.splitlines() if " — " in line]
    assert len(verdicts) == 1 and ": slow node: node node-1 (ranks 2, 3) in the job — " in verdicts[0], live


@pytest.mark.across_nodes
def test_a_slow_link_is_named_as_the_network_and_nothing_else_is(tmp_path, harness):
    """Node 1's link limited to 1 Mbit/s both ways mid-training, once the rules judge every rank: every
    collective that crosses it slows, on every rank, and the ranks that send across it arrive last
    behind it. ``CommlensNetworkSlow`` fires, no alert names a rank or a node, and ``commlens diagnose
    --prometheus`` prints that one verdict. About 65 s."""
    with _cluster(tmp_path, steps=3000) as (nodes, job, webhook, prometheus, _):
        _judged(prometheus)
        nodes.limit(1, "1mbit")
        wait_for(lambda: webhook.firing("CommlensNetworkSlow"), "CommlensNetworkSlow at the webhook", timeout_s=60,
                 explain=lambda: f"{webhook.alerts} {_logs(job)}")
        live = _diagnose("--prometheus", f"http://127.0.0.1:{prometheus.port}")
        named = {(a["labels"]["alertname"], a["labels"].get("node"), a["labels"].get("rank"))
                 for a in webhook.alerts if a["labels"]["alertname"] in CULPRIT_ALERTS}
    assert named == {("CommlensNetworkSlow", None, None)}, webhook.alerts
    verdicts = [line for line in live.splitlines() if " — " in line]
    assert len(verdicts) == 1 and ": the network is slow, no rank is late: every rank waits in the job — " in verdicts[0], live


@pytest.mark.across_nodes
def test_a_healthy_job_across_nodes_fires_nothing_and_sends_every_nodes_spans_to_one_receiver(tmp_path, harness):
    """The same job, no fault, to its end: once it is under way, no alert that names a culprit fires,
    and every node's command ends 0. One may be pending: three nodes share this host's cores with other
    tests' jobs, and a node's share of them wanders; a node's ranks starved for a moment arrive last in
    10 s windows for a few evaluations (CI saw ``CommlensNodeSlow`` pending at 9 evaluations of one run,
    and not fire), which its ``for`` is there to outlast. (At start-up, on a busy machine, the ranks can
    wait past the tests' 3 s hang threshold in DDP's first collective, for a rank still building its
    model: a hang by that threshold, over once the job is under way.) Every node's pod sidecar sends its
    spans over OTLP/gRPC to one receiver, each rank's under its node's ``host.name``. About 30 s."""
    with _cluster(tmp_path, steps=400, spans=True) as (nodes, job, webhook, prometheus, receiver):
        wait_for(lambda: prometheus.query('commlens_collective_last_seq{pg="0", state="completed"} > 2'),
                 "the job under way on every node")
        under_way = time.time() + 1  # one evaluation on
        assert job.wait(120) == [0, 0, 0], _logs(job)
        window, culprits = max(1, int(time.time() - under_way)), "|".join(CULPRIT_ALERTS)
        fired = prometheus.query(f'max_over_time(ALERTS{{alertname=~"{culprits}", alertstate="firing"}}[{window}s])')
        exported = prometheus.query("sum by (rank, result) (commlens_spans_exported_total)")
    assert fired == [] and webhook.alerts == [], (fired, webhook.alerts, exported)
    ranks_by_host = {(resource.get("host.name"), span_attributes(span).get(names.RANK))
                     for resource, span in spans_of(receiver.requests)}
    assert ranks_by_host == {(f"node-{rank // 2}", rank) for rank in range(6)}, ranks_by_host


def test_an_unreachable_node_is_named_only_while_others_wait_and_its_own_ranks_do_not():
    """Facts as ``--prometheus`` reads them: node 1 unreachable while rank 0 waits in seq 40 names node
    1; a node torn down after it, whose rank saw its op fail, is not named; nor is an unreachable node
    while nobody waits; nor is rank 2, whose numbers froze when its node went, a straggler in group 6
    where its peer's waits on it grew."""
    facts = [RankFacts(rank, node=f"node-{rank // 2}") for rank in range(6)]
    for f in facts[2:4]:
        f.unreachable = True
    facts[0].group("4").failed = ("all_reduce", 40)
    facts[4].unreachable = facts[5].unreachable = facts[5].aborted = True
    facts[2].group("4").hung, facts[2].group("4").finished = ("all_gather", 1), 39  # a wait at start-up, over
    for rank, (wait_s, waited_s) in ((1, (0.2, 0.5)), (2, (0.001, 0.05))):
        group = facts[rank].group("6")
        group.wait_s, group.waited_s, group.completed = wait_s, waited_s, 50
    found = findings(facts)
    assert [(f.kind, f.node, f.ranks, f.pg, f.seq) for f in found] == [("node_unreachable", "node-1", (2, 3), "4", 40)]
    assert found[0].line().startswith("unreachable: node node-1 (ranks 2, 3) in all_reduce (group 4, seq 40) — ")
    facts[0].group("4").failed = None
    facts[5].aborted = False
    assert not any(f.kind == "node_unreachable" for f in findings(facts))


def test_the_ranks_found_late_are_one_nodes_all_and_only_the_node_is_named_slow():
    """Ranks 2 and 3, node 1's two, straggle in their data-parallel groups: the node is named, alive but
    slow; with rank 4 of node 2 named too, or a single node's job, the ranks are named as they are."""
    facts = [RankFacts(rank, node=f"node-{rank // 2}") for rank in range(6)]
    for pg, ranks in (("4", (0, 2, 4)), ("5", (1, 3, 5))):
        for rank in ranks:
            group = facts[rank].group(pg)
            group.wait_s, group.waited_s, group.completed = (0.001, 0.05, 50) if rank in (2, 3) else (0.2, 0.5, 50)
    found = findings(facts)
    assert [(f.kind, f.node, f.ranks) for f in found] == [("node_slow", "node-1", (2, 3))], found
    assert found[0].line().startswith("slow node: node node-1 (ranks 2, 3) in the job — every rank of the node")
    facts[4].group("4").wait_s, facts[4].group("4").waited_s = 0.0005, 0.025  # last in group 4 now
    assert {f.kind for f in findings(facts)} != {"node_slow"}
    for f in facts:
        f.node = "node-0"
    facts[4].group("4").wait_s, facts[4].group("4").waited_s = 0.2, 0.5
    assert {f.kind for f in findings(facts)} == {"straggler"}


def test_a_node_whose_ranks_arrive_last_while_waiting_in_their_own_groups_is_named_slow():
    """A node throttled: ranks 2 and 3 arrive last in the groups they share with other nodes, and wait in
    their own pair (everything they do is slow), so neither is a straggler; the node is named. Not while
    a rank waits past the hang threshold, nor where one of its ranks is on time, nor behind a slow link,
    where the ranks that arrive last spend as much time in collectives as the others."""
    facts = [RankFacts(rank, node=f"node-{rank // 2}") for rank in range(6)]
    for pg, ranks in (("1", (2, 3)), ("4", (0, 2, 4)), ("5", (1, 3, 5))):
        for rank in ranks:
            group = facts[rank].group(pg)
            late = rank in (2, 3) and pg != "1"
            group.wait_s, group.waited_s, group.completed = (0.002, 0.05, 200) if late else (0.02, 0.4, 200)
            if pg == "1":
                group.waited_s = 0.2  # their own pair's: 0.25 s a second in all, where the others spend 0.4
    facts[4].group("4").hung, facts[4].group("4").finished = ("all_gather", 1), 199  # a wait at start-up, over
    found = findings(facts)
    assert [(f.kind, f.node, f.ranks) for f in found] == [("node_slow", "node-1", (2, 3))], found
    facts[0].group("4").hung = ("all_reduce", 7)
    assert not any(f.kind == "node_slow" for f in findings(facts))
    facts[0].group("4").hung = None
    facts[3].group("5").wait_s, facts[3].group("5").waited_s = 0.02, 0.4  # on time
    assert findings(facts) == []
    facts[3].group("5").wait_s, facts[3].group("5").waited_s = 0.002, 0.05
    facts[2].group("1").waited_s = facts[3].group("1").waited_s = 0.5  # waiting on the link as long as anyone
    assert not any(f.kind == "node_slow" for f in findings(facts))


def test_behind_a_slow_link_a_node_that_arrives_last_and_waits_a_little_less_is_not_named_slow():
    """Node 1's link slow: node 2's ranks arrive last in the data-parallel groups across the nodes and
    spend 8 % less of their time in collectives than any other rank, as a slow node's do; but they, as
    every rank, spend under half the time outside collectives that they did minutes before: the network
    is slow, no node. Where node 2's ranks spend as much time outside collectives as they did (computing
    longer, as a slow node's do, while the others wait more), the node is slow."""
    facts = [RankFacts(rank, node=f"node-{rank // 2}", least_waited=0.1) for rank in range(6)]
    for pg, ranks in (("1", (0, 1)), ("2", (2, 3)), ("3", (4, 5)), ("4", (0, 2, 4)), ("5", (1, 3, 5))):
        for rank in ranks:
            group, last = facts[rank].group(pg), rank in (4, 5)
            if pg in ("4", "5"):
                group.wait_s, group.waited_s = (0.002, 0.03) if last else (0.03, 0.3)
            else:
                group.wait_s, group.waited_s = (0.04, 0.84) if last else (0.03, 0.65)
            group.completed = 200
    found = findings(facts)
    assert [(f.kind, f.node) for f in found] == [("network_slow", "")], found
    for f in facts[4:]:
        f.least_waited = 0.85
    assert [(f.kind, f.node, f.ranks) for f in findings(facts)] == [("node_slow", "node-2", (4, 5))]


def test_a_slow_link_is_named_as_the_network_and_no_rank_or_node_is():
    """Node 1's link slow: node 0's ranks, blocked in their sends across it, arrive last in the
    data-parallel groups, and every rank waits most of its time in the pipeline's groups, as it did not
    a few minutes before: the network is slow, no rank is late. Not on one node, nor while the job
    spends as much of its time in collectives as it has for 5 min."""
    facts = [RankFacts(rank, node=f"node-{rank // 2}") for rank in range(6)]
    for pg, ranks in (("4", (0, 2, 4)), ("5", (1, 3, 5)), ("6", (0, 2, 4)), ("7", (1, 3, 5))):
        for rank in ranks:
            group = facts[rank].group(pg)
            if pg in ("4", "5"):
                group.wait_s = group.waited_s = 0.007 if rank in (0, 1) else 0.05
            else:
                group.wait_s = group.waited_s = 0.95 if rank in (0, 1) else 0.9
            group.completed = 100
    for f in facts:
        f.least_waited = 0.1
    found = findings(facts)
    assert [(f.kind, f.node) for f in found] == [("network_slow", "")], found
    assert found[0].line().startswith("the network is slow, no rank is late: every rank waits in the job — "
                                      "every rank spends 95%–96% of its time in collectives")
    for f in facts:
        f.least_waited = 0.94
    assert findings(facts) == []
    for f in facts:
        f.least_waited, f.node = 0.1, "node-0"
    assert findings(facts) == []
