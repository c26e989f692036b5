"""The verdict, end to end, on faults written into an ordinary training script run under
``commlens run -- torchrun`` (3 gloo ranks): Debian's Prometheus (1 s scrape and evaluation) evaluates
the shipped rules and sends to a real Alertmanager; the alert that fires, ``commlens diagnose`` live
from Prometheus and after the fact from the job's files, and ``torchfrtrace`` where it can, all name
the faulty rank — and only it. A healthy run fires nothing and leaves nothing pending. Each test runs
twice: with commlens exporting from every rank (one target per rank), and with the ranks running
only the hot path beside one pod sidecar process (``commlens run --sidecar``: one target per pod)."""

import contextlib
import json
import pathlib
import pickle
import re
import subprocess
import sys
import time

import pytest

from commlens.agent.verdicts import findings
from commlens.agent.verdicts.catalogue import VERDICT_ALERTS
from commlens.agent.verdicts.facts import RankFacts
from commlens.agent.verdicts.readers import from_files, from_metrics_texts, spans_in
from commlens.exporters import names
from monitoring import (MATRIX_SCRIPT, PARALLEL_SCRIPT, Alertmanager, Prometheus, TrainingJob, Webhook, culprits, wait_for,
                        wait_training)

RULES = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "prometheus-rules.yaml"
WORLD, CULPRIT = 3, 1
CULPRIT_ALERTS = VERDICT_ALERTS


@contextlib.contextmanager
def _stack(tmp_path, fault, world=WORLD, query_log=False, **job):
    """The job started once Prometheus scrapes its targets, as a cluster's Prometheus runs before a job
    does: a fault in the job's first second (a rank killed at step 30) has its endpoint scraped. Yields
    once the job's start-up is over (``wait_training``)."""
    with Webhook() as webhook, Alertmanager(tmp_path, webhook.url) as alertmanager, \
            TrainingJob(tmp_path, world, fault, rank=CULPRIT, start_now=False, **job) as training, \
            Prometheus(tmp_path, training, [RULES], alertmanager.address, query_log=query_log) as prometheus:
        wait_for(lambda: len(prometheus.query("up")) == len(training.targets), "Prometheus' first scrapes")
        training.start()
        wait_training(prometheus, training)
        yield webhook, training, prometheus


def _evidence(prometheus, training) -> str:
    """What Prometheus holds of the rules' evidence, and the end of the job's log."""
    series = {}
    for expression in ("up", "ALERTS", "last_over_time(commlens_collective_hung_seq[15m])",
                       "last_over_time(commlens_collective_failed_seq[15m])",
                       'last_over_time(commlens_collective_last_seq{state="enqueued"}[15m])'):
        series[expression] = [(s["metric"], s["value"][1]) for s in prometheus.query(expression)]
    return f"Prometheus: {series}; the job's log ends: {training.log.read_text()[-3000:]}"


def _diagnose(*args) -> str:
    done = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", *args], capture_output=True,
                          text=True, timeout=60)
    return done.stdout + done.stderr


EXPORTERS = pytest.mark.parametrize("pod", [False, True], ids=["per-rank", "pod-sidecar"])


@pytest.mark.parametrize("fault, alert, verdict, op, pod", [
    ("nan", "CommlensNaNOrigin", "NaN/Inf entered on rank 1", "all_reduce", False),
    ("inf", "CommlensNaNOrigin", "NaN/Inf entered on rank 1", "all_reduce", True),
    ("late", "CommlensRankLate", "late or missing: rank 1 ", "all_reduce", True),
    ("leave", "CommlensRankLate", "late or missing: rank 1 ", "all_reduce", False),
    ("slow", "CommlensStraggler", "straggler: rank 1 ", None, True),
    ("desync", "CommlensCollectiveDesync", "desync: rank 1 ", "all_gather", False),
], ids=["nan-per-rank", "inf-pod-sidecar", "late-pod-sidecar", "leave-per-rank", "slow-pod-sidecar", "desync-per-rank"])
def test_the_alert_and_diagnose_name_the_faulty_rank_and_only_it(tmp_path, fault, alert, verdict, op, pod):
    """Each fault with one exporter, each exporter with three: a pod sidecar serves its ranks the series a
    rank's own endpoint serves (the same collector), which the rules and detectors read alike; both run in
    the healthy runs and the matrix (``test_matrix.py``), which draws the culprit from every position of
    larger jobs."""
    # A straggler's verdict needs no hang threshold; at the others' 3 s, a stall of this 2-core machine
    # while a rank computes made its ranks wait past it, and the verdict was rightly "late or missing".
    # A late rank stays late until the test has asked every reader: at 8 s (the script's default) it
    # caught up in one CI run before the live diagnose, run after the alert's delivery, had read it.
    job = {"hang_threshold_s": 60} if fault == "slow" else {"extra": ["--late-s", "60"]} if fault == "late" else {}
    with _stack(tmp_path, fault, pod=pod, **job) as (webhook, training, prometheus):
        fired = wait_for(lambda: webhook.firing(alert), f"{alert} at the webhook", timeout_s=90,
                         explain=lambda: _evidence(prometheus, training))
        named = {a["labels"].get("rank", a["labels"].get("node")) for a in webhook.alerts
                 if a["labels"]["alertname"] in CULPRIT_ALERTS and a["status"] == "firing"}
        if fault == "slow":  # its cost below is the steady state's: live diagnose's 15 s holds only training
            wait_for(lambda: prometheus.query("commlens_collective_duration_seconds_count offset 16s"),
                     "16 s of training in Prometheus", explain=lambda: _evidence(prometheus, training))
        live = _diagnose("--prometheus", f"http://127.0.0.1:{prometheus.port}")
        if fault != "leave":  # the ranks' own endpoints, while they still serve
            endpoints = _diagnose("--metrics", *(f"http://{target}/metrics" for target in training.targets),
                                  "--window", "2")
        hung = fault in ("late", "leave", "desync")
        if hung:  # the others hang until gloo's timeout; the dumps of every rank are written meanwhile
            wait_for(lambda: all((training.out / f"rank_{r}").exists() for r in range(WORLD) if fault != "leave"
                                 or r != CULPRIT), "every rank's dump")
    assert named == {str(CULPRIT)}, webhook.alerts
    for a in fired:
        assert a["labels"]["rank"] == str(CULPRIT) and a["labels"].get("pg", "0") == "0"
        if op:
            assert a["labels"]["op"] == op
    for report in (live, endpoints) if fault != "leave" else (live,):
        assert verdict in report and culprits(report) == {CULPRIT}, report
    offline = _diagnose(str(training.out))
    assert verdict in offline, offline
    if fault == "slow":  # its cost: the 2 others wait ~30 ms of its ~55 ms steps, a third of the job's time
        for report in (live, endpoints, offline):
            share = re.search(r"cost the job (?:[\d.]+ rank-seconds, )?([\d.]+)% of its time", report)
            assert share and 15 <= float(share[1]) <= 60, report
    if hung:
        seq = int(float(fired[0]["annotations"]["summary"].split("seq ")[1].split()[0]))
        assert f"seq {seq})" in live and f"seq {seq})" in offline, (seq, live, offline)
        analyzer = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                                   str(training.out)], capture_output=True, text=True, timeout=120)
        report = analyzer.stdout + analyzer.stderr
        if fault == "desync":
            assert "COLLECTIVE_TYPE_MISMATCH" in report, report
        elif fault == "leave":
            assert f"{{{CULPRIT}}}" in report, report  # its process ended without a dump: "missing ... {1}"


def _scrape(waits_ms: dict[int, float], count: int, p2p_hung: int | None = None) -> list[str]:
    """Each rank's metrics text after ``count`` collectives of group 5, ``waits_ms[rank]`` each."""
    texts = []
    for rank, wait_ms in waits_ms.items():
        labels = f'rank="{rank}",pg="5",op="all_reduce"'
        text = (f"{names.COLLECTIVE_DURATION}_sum{{{labels}}} {count * wait_ms / 1e3}\n"
                f"{names.COLLECTIVE_DURATION}_count{{{labels}}} {count}\n")
        if rank == p2p_hung:
            text += f'{names.P2P_HUNG}{{rank="{rank}",pg="6",op="recv",peer="0"}} 9.0\n'
        texts.append(text)
    return texts


@pytest.mark.parametrize("count, p2p_hung, named", [(20, None, {2}), (3, None, set()), (20, 2, set())],
                         ids=["evidence", "too-few-collectives", "waiting-itself"])
def test_a_live_straggler_is_named_from_enough_collectives_and_never_while_it_waits_itself(count, p2p_hung, named):
    """Rank 2 waits 0.5 ms per collective of group 5 where the others wait 8 ms: it arrives last. Named
    from 20 collectives in the window; not from 3 (a job's loss averaged every 10 steps: in a CI run the
    window held the start and a stall, and rank 2 was named while it waited in ``recv`` for a rank held
    up elsewhere), nor while it waits itself past the hang threshold. Its cost: the others' waits for it,
    as a share of the job's time."""
    waits = {0: 8.2, 1: 8.0, 2: 0.5, 3: 8.1}
    zero = _scrape(waits, 0, p2p_hung)
    found = [f for f in findings(from_metrics_texts(zero, _scrape(waits, count, p2p_hung), 20.0))
             if f.kind == "straggler"]
    assert {rank for f in found for rank in f.ranks} == named
    if named:  # the others wait 22.8 ms a second for it, of the 4 ranks' 4 rank-seconds a second
        assert found[0].evidence.endswith("the waits for it cost the job 0.6% of its time over the window")


@pytest.mark.parametrize("last_ms, named", [(21.0, {3}), (39.0, set())], ids=["slow-last-stage", "healthy"])
def test_a_live_pipeline_straggler_is_the_stage_that_spends_least_of_its_time_in_the_pipelines_ops(last_ms, named):
    """A pipeline of 4 stages (group 1) over 20 s: the ends send and receive once per micro-batch each way,
    the middle stages twice as often, so a middle stage waits least per op while the last stage, 21 ms
    per op where the first waits 36 ms, spends 25 % of its time in the pipeline's ops and the others 47
    to 59 %: it computes while they wait, and is named. At 39 ms per op it spends as much as the others:
    nobody is."""
    counts, waits_ms = {0: 260, 1: 520, 2: 520, 3: 240}, {0: 36.0, 1: 18.0, 2: 22.6, 3: last_ms}
    texts = []
    for at in (0, 1):
        texts.append(["".join(f'{names.COLLECTIVE_DURATION}_{what}{{rank="{rank}",pg="1",op="recv"}} {value}\n'
                              for what, value in (("sum", at * counts[rank] * waits_ms[rank] / 1e3),
                                                  ("count", at * counts[rank]))) for rank in counts])
    found = [f for f in findings(from_metrics_texts(*texts, 20.0)) if f.kind == "straggler"]
    assert {rank for f in found for rank in f.ranks} == named, [f.line() for f in found]


@pytest.mark.parametrize("shares, named", [
    ({0: 0.40, 1: 0.79, 2: 0.78, 3: 0.75}, {0}), ({0: 0.6, 1: 0.6, 2: 0.6, 3: 0.4}, set())],
    ids=["slow-first-stage", "healthy-bubble"])
def test_where_a_pipeline_waits_most_of_its_time_a_straggler_waits_a_quarter_of_the_wall_clock_less(tmp_path, shares,
                                                                                                   named):
    """A pipeline of 4 stages (group 1) over 20 s whose stages wait over half their time (its bubble):
    stage 0 loads its data 60 ms longer a step and spends 40 % of its time in the pipeline's ops, waiting
    for its gradients, where the others spend 75 to 79 %: over half as much, and 0.39 of the wall clock
    less; it is named, live and after the fact (where the others' waits grew, one was a slow outlier: no
    stall, under a second). A healthy pipeline whose last stage computes the loss besides, 40 % where
    the others spend 60 %: 0.2 of the wall clock less, nobody."""
    counts = {0: 80, 1: 160, 2: 160, 3: 80}  # ops in 20 s: the middle stages exchange twice as often
    texts = []
    for at in (0, 1):
        texts.append(["".join(f'{names.COLLECTIVE_DURATION}_{what}{{rank="{rank}",pg="1",op="recv"}} {value}\n'
                              for what, value in (("sum", at * shares[rank] * 20), ("count", at * counts[rank])))
                      for rank in counts])
    found = [f for f in findings(from_metrics_texts(*texts, 20.0)) if f.kind == "straggler"]
    assert {rank for f in found for rank in f.ranks} == named, [f.line() for f in found]
    spans = {rank: [] for rank in shares}  # after the fact: 40 steps of 100 ms, each op's share as above
    for rank in shares:
        for step in range(40):
            t = 10**18 + step * 100_000_000
            spans[rank].append((rank, "1", step + 1, t, t + round(shares[rank] * 100_000_000)))
    p2p = {names.P2P: 1, names.OP: "recv"}
    for rank, its in spans.items():  # rank 1's recv of step 5 a slow outlier, as where the fault began
        _write_spans(tmp_path / f"traces-{rank}.jsonl", its[:5] + its[6:], **p2p, **{names.PEER: (rank + 1) % 4})
        _write_spans(tmp_path / f"traces-{rank}.jsonl", its[5:6], **p2p, **{names.PEER: (rank + 1) % 4},
                     **({names.SLOW: 1} if rank == 1 else {}))
    found = [f for f in findings(from_files(str(tmp_path), on_problem=pytest.fail)) if f.kind == "straggler"]
    assert {rank for f in found for rank in f.ranks} == named, [f.line() for f in found]


def test_a_stragglers_partner_last_in_its_pipeline_group_because_it_waits_for_it_is_a_link_not_named(tmp_path):
    """A CI-shaped matrix cell (``tp-pp-dp:slow-compute:pod:3``): rank 3 computes longer; its pair's rank 2
    waits 60 ms an op for it (group 2), so sends its gradients late, and its first stage, rank 0, waits
    82 % of its time in their pipeline group 5 where rank 2 waits 20 %: rank 2 is last there, 0.44 of
    its time in collectives in all, 0.38 under rank 0. But rank 3, last in the pair, spends 0.204: rank 2
    waits for it. Rank 3 alone is named."""
    shares = {("2", 3): 0.004, ("2", 2): 0.24, ("5", 0): 0.82, ("5", 2): 0.2, ("6", 1): 0.82, ("6", 3): 0.2}
    texts = []
    for at in (0, 1):
        texts.append(["".join(f'{names.COLLECTIVE_DURATION}_{what}{{rank="{rank}",pg="{pg}",op="all_reduce"}} {value}\n'
                              for (pg, r), share in shares.items() if r == rank
                              for what, value in (("sum", at * share * 20), ("count", at * 80)))
                      for rank in range(4)])
    found = [f for f in findings(from_metrics_texts(*texts, 20.0)) if f.kind == "straggler"]
    assert {rank for f in found for rank in f.ranks} == {3}, [f.line() for f in found]


@pytest.mark.parametrize("shares, named", [
    ({("5", 0): 0.76, ("9", 0): 0.04, ("6", 1): 0.76, ("9", 1): 0.04,
      ("5", 2): 0.46, ("11", 2): 0.02, ("6", 3): 0.46, ("11", 3): 0.02}, set()),
    ({("5", 0): 0.80, ("9", 0): 0.04, ("6", 1): 0.80, ("9", 1): 0.04,
      ("5", 2): 0.24, ("11", 2): 0.01, ("6", 3): 0.40, ("11", 3): 0.25}, {(2, "11")}),
    ({("5", 0): 0.80, ("0", 0): 0.04, ("5", 1): 0.24, ("0", 1): 0.04}, {(1, "5")})],
    ids=["healthy-last-stage", "slow-last-stage-replica", "slow-stage-without-peers"])
def test_a_pipelines_stage_with_peers_is_judged_against_them_not_against_the_other_stages(shares, named):
    """Two pipelines of two stages (groups 5 and 6: ``recv``, no sequence numbers) over 20 s, each stage's
    replicas in a data-parallel group of collectives (9, 11). Healthy, the last stages compute the loss
    besides: ranks 2 and 3 spend 0.48 of their time in collectives where the first stages spend 0.8,
    0.32 less, and arrive last in the pipeline; but together in their data-parallel all_reduce, which
    judges them: nobody is named (CI saw a healthy 8-rank job's last stage named so on a starved host).
    Rank 2 loading its data longer spends 0.25, and rank 3 waits for it in their all_reduce: rank 2 is
    named, there, and only it. A pipeline without replicas, whose only collectives are the whole job's
    (every stage's, different work), is judged on its stages: the slow last stage is named there."""
    p2p, ranks = ("5", "6"), sorted({rank for _, rank in shares})
    counts = {pg: 80 if pg in p2p else 40 for pg, _ in shares}
    texts = []
    for at in (0, 1):
        texts.append(["".join(f'{names.COLLECTIVE_DURATION}_{what}{{rank="{rank}",pg="{pg}",op="{op}"}} {value}\n'
                              for (pg, r), share in shares.items() if r == rank
                              for op in ("recv" if pg in p2p else "all_reduce",)
                              for what, value in (("sum", at * share * 20), ("count", at * counts[pg])))
                      + "".join(f'{names.LAST_SEQ}{{rank="{rank}",pg="{pg}",state="{state}"}} {(at + 1) * counts[pg]}\n'
                                for (pg, r) in shares if r == rank and pg not in p2p
                                for state in ("enqueued", "completed"))
                      for rank in ranks])
    found = [f for f in findings(from_metrics_texts(*texts, 20.0)) if f.kind == "straggler"]
    assert {(f.ranks[0], f.pg) for f in found} == named, [f.line() for f in found]


def test_a_straggler_is_named_from_the_endpoints_beside_a_group_idle_in_the_window():
    """Two scrapes of a 2-rank job's endpoints 20 s apart: rank 1 spends 5 % of its time in group 1's 40
    all_reduces, rank 0 60 %; both issued one barrier in group 0 at start-up, none since. The idle
    group's window is whole (nothing happened in it): rank 1 is named."""
    texts = []
    for at in (0, 1):
        texts.append(["".join(f'{names.COLLECTIVE_DURATION}_{what}{{rank="{rank}",pg="{pg}",op="{op}"}} {value}\n'
                              for pg, op, share, count in (("1", "all_reduce", at * (0.6, 0.05)[rank], at * 40),
                                                           ("0", "barrier", 0.5 / 20, 1))
                              for what, value in (("sum", share * 20), ("count", count)))
                      + "".join(f'{names.LAST_SEQ}{{rank="{rank}",pg="{pg}",state="{state}"}} {seq}\n'
                                for pg, seq in (("1", 40 * (at + 1)), ("0", 1)) for state in ("enqueued", "completed"))
                      for rank in range(2)])
    found = [f for f in findings(from_metrics_texts(*texts, 20.0)) if f.kind == "straggler"]
    assert [(f.ranks, f.pg) for f in found] == [((1,), "1")], [f.line() for f in found]


def test_after_the_fact_a_pipeline_straggler_is_named_by_its_share_of_time_in_the_pipelines_ops(tmp_path):
    """Point-to-point spans of a pipeline of 4 stages (group 1), 40 steps of 100 ms: stage 3 computes
    80 ms of each; stages 0 to 2 compute 20 ms and spend the rest in their sends and recvs, waiting for
    it. Stage 3 spends 20 % of its time in the pipeline's ops, the others 80 %: it alone is named. A
    pipeline of equal stages whose stage 3 was 5 s late once, the others waiting past the hang threshold
    for it (the hang findings name it), names no straggler: over the job its share would take that in."""
    ms = 1_000_000

    def write(folder: pathlib.Path, late: bool) -> None:
        for rank in range(4):
            spans, hung, t = [], [], 10**18
            for step in range(40):
                extra = 5000 * ms if late and step == 20 and rank != 3 else 0
                busy = ((50 if rank < 3 else 45) if late else (80 if rank < 3 else 20)) * ms  # in its ops
                (hung if extra else spans).append((rank, "1", 2 * step + 1, t, t + busy // 2 + extra))
                spans.append((rank, "1", 2 * step + 2, t + busy // 2 + extra, t + busy + extra))
                t += 100 * ms + (5000 * ms if late and step == 20 else 0)
            p2p = {names.P2P: 1, names.OP: "recv", names.PEER: (rank + 1) % 4}
            _write_spans(folder / f"traces-{rank}.jsonl", spans, **p2p)
            _write_spans(folder / f"traces-{rank}.jsonl", hung, **p2p, **{names.HANG: 1})

    write(tmp_path, late=False)
    found = findings(from_files(str(tmp_path), on_problem=pytest.fail))
    assert [(f.kind, f.ranks) for f in found] == [("straggler", (3,))], [f.line() for f in found]
    (tmp_path / "late").mkdir()
    write(tmp_path / "late", late=True)
    found = findings(from_files(str(tmp_path / "late"), on_problem=pytest.fail))
    assert not [f for f in found if f.kind == "straggler"], [f.line() for f in found]


@pytest.mark.parametrize("slow_from_s, named", [(60, {2}), (None, set())], ids=["slow-from-60-s", "healthy"])
def test_after_the_fact_a_pipeline_straggler_that_began_mid_job_is_named_over_the_jobs_last_seconds(
        tmp_path, slow_from_s, named):
    """Point-to-point spans of a pipeline of 4 stages (group 1), 90 s of 100 ms steps, each stage 50 % of
    its time in its sends and recvs; from 60 s on stage 2 loads its data 30 ms longer, and spends 20 %
    there while the others wait, 80 %. Over the job it spent 40 % where the others spent 60 %: a
    quarter under, not what the others wait for; over the job's last 20 s, as live saw it then, 20 %
    against 80 %: it is named, and only it. A healthy job: nobody."""
    ms = 1_000_000
    for rank in range(4):
        spans = []
        for step in range(900):
            slow = slow_from_s is not None and step >= slow_from_s * 10
            busy = (20 if rank == 2 else 80) * ms if slow else 50 * ms
            t = 10**18 + step * 100 * ms
            spans += [(rank, "1", 2 * step + 1, t, t + busy // 2), (rank, "1", 2 * step + 2, t + busy // 2, t + busy)]
        _write_spans(tmp_path / f"traces-{rank}.jsonl", spans, **{names.P2P: 1, names.OP: "recv",
                                                                    names.PEER: (rank + 1) % 4})
    found = findings(from_files(str(tmp_path), on_problem=pytest.fail))
    assert {rank for f in found for rank in f.ranks} == named, [f.line() for f in found]
    if named:
        assert [f.kind for f in found] == ["straggler"]
        assert "it spent 20% of its time in the group's point-to-point ops where the member that spent most " \
               "spent 80%, over its last 20 s" in found[0].line(), found[0].line()


def _killed(partner_failed: bool) -> list[str]:
    """A pod sidecar's metrics text as a torn-down job left it: rank 1 killed inside its pair's (group 1)
    all_reduce seq 31; rank 0 waited past the hang threshold in the job's loss all_reduce (group 0) seq
    3 at the start, which resolved; and, if ``partner_failed``, rank 0's all_reduce seq 31 failed."""
    seq, hung, failed = names.LAST_SEQ, names.HUNG_SEQ, names.FAILED_SEQ
    lines = [f'{seq}{{pg="0",state="{state}",rank="{rank}"}} 3' for rank in range(4) for state in ("enqueued", "completed")]
    lines += [f'{seq}{{pg="{1 + rank // 2}",state="enqueued",rank="{rank}"}} 31' for rank in range(4)]
    lines += [f'{seq}{{pg="{1 + rank // 2}",state="completed",rank="{rank}"}} 30' for rank in range(4)]
    lines += [f'{hung}{{pg="0",op="all_reduce",rank="0"}} 3', f'{names.RANK_UP}{{rank="1"}} 0',
              f'{names.total(names.ABORT_SNAPSHOTS)}{{reason="exit",rank="1"}} 1']
    if partner_failed:
        lines.append(f'{failed}{{pg="1",op="all_reduce",rank="0"}} 31')
    return ["\n".join(lines) + "\n"]


@pytest.mark.parametrize("partner_failed, verdict", [
    (True, "killed or crashed: rank 1 in all_reduce (group 1, seq 31)"),
    (False, "killed or crashed: rank 1 in a collective (group 1, seq 31)"),
], ids=["partner-failed", "torn-down-first"])
def test_a_killed_rank_is_named_once_in_the_collective_it_had_in_flight(partner_failed, verdict):
    """A CI run named rank 1 killed in group 0's seq 3, where rank 0 had waited at the start (its hang
    kept for a minute), and not in group 1, where it died: torchrun tore the job down before rank 0's
    failure was scraped. The collective it had in flight (issued, not completed) says where it died."""
    text = _killed(partner_failed)
    lines = [f.line() for f in findings(from_metrics_texts(text, text, 5.0))]
    assert len(lines) == 1 and lines[0].startswith(verdict), lines


def test_a_killed_rank_is_named_from_its_files_in_the_collective_its_dump_has_in_flight(tmp_path):
    """A CI run named rank 1, killed inside group 1's seq 31, in group 0's seq 3: rank 0 had completed seq 31
    (rank 1 sent its part before it died) and failed next in group 0, the one wait the files held. The pod
    sidecar's dump of a killed rank has the collective it died in, started and not completed."""
    def entry(pg: str, seq: int, state: str) -> dict:
        return {"process_group": (pg, "undefined"), "collective_seq_id": seq, "profiling_name": "gloo:all_reduce",
                "input_sizes": [[32, 64]], "input_dtypes": ["Float"], "state": state, "is_p2p": False}

    dumps = {0: ([entry("0", 3, "completed"), entry("1", 31, "completed"), entry("0", 4, "started")],
                 ["exception", "signal", "exit"]),
             1: ([entry("0", 3, "completed"), entry("1", 30, "completed"), entry("1", 31, "started")], ["exit"])}
    for rank, (entries, reasons) in dumps.items():
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps({"version": "2.10", "entries": entries,
                                                              "commlens_reasons": reasons}))
    lines = [f.line() for f in findings(from_files(str(tmp_path), on_problem=lambda problem: None))]
    assert len(lines) == 1 and lines[0].startswith("killed or crashed: rank 1 in all_reduce (group 1, seq 31)"), lines


@pytest.mark.parametrize("still_running, verdict", [
    (False, "late or missing: rank 1 in all_reduce (group 0, seq 25)"),
    (True, "late or missing: ranks 1, 3 in all_reduce (group 0, seq 25)"),
], ids=["ended", "still-running"])
def test_a_rank_torn_down_with_the_job_is_not_named_late_with_the_rank_that_set_it_off(still_running, verdict):
    """Without a pod sidecar: rank 1 is killed, ranks 0 and 2 fail in group 0's seq 25 for it, and
    torchrun stops rank 3 (its ``signal`` snapshot scraped on its way down) before it issued seq 25. Once
    rank 3 has ended, only rank 1 is late (a benchmark run of the kill fault once alerted rank 3 too);
    while it still runs after the signal (a handler that checkpoints), it is behind as any rank is."""
    def text(rank: int) -> str:
        lines = [f'{names.LAST_SEQ}{{pg="0",state="enqueued",rank="{rank}"}} {25 if rank in (0, 2) else 24}',
                 f'{names.total(names.ABORT_SNAPSHOTS)}{{reason="signal",rank="{rank}"}} {int(rank == 3)}']
        if rank in (0, 2):
            lines.append(f'{names.FAILED_SEQ}{{pg="0",op="all_reduce",rank="{rank}"}} 25')
        return "\n".join(lines) + "\n"
    first, second = [text(rank) for rank in range(4)], [text(0), text(2)] + [text(3)] * still_running
    lines = [f.line() for f in findings(from_metrics_texts(first, second, 5.0))]
    assert len(lines) == 1 and lines[0].startswith(verdict), lines


def _late_rank_one(webhook, training, prometheus, alert: str, evidence: str, why: str) -> tuple[set, str]:
    """Wait for ``alert`` and for ``evidence`` (a query) in Prometheus, diagnose live, then let the job
    finish (the late rank catches up): the (alertname, rank) of every culprit alert fired, and the
    live verdict."""
    wait_for(lambda: webhook.firing(alert), f"{alert} at the webhook", timeout_s=90,
             explain=lambda: _evidence(prometheus, training))
    wait_for(lambda: prometheus.query(evidence), why, explain=lambda: _evidence(prometheus, training))
    live = _diagnose("--prometheus", f"http://127.0.0.1:{prometheus.port}")
    assert training.wait(120) == 0, training.log.read_text()[-3000:]
    fired = {(a["labels"]["alertname"], a["labels"]["rank"]) for a in webhook.alerts
             if a["labels"]["alertname"] in CULPRIT_ALERTS and a["status"] == "firing"}
    return fired, live


def test_a_rank_late_in_its_tensor_parallel_pair_is_named_and_the_ranks_held_up_by_it_are_not(tmp_path):
    """4 ranks, four kinds of group at once (``tests/parallel_train.py``). Rank 1 comes late to its
    pair's all_reduce: rank 0 waits for it there, rank 3 waits in ``recv`` for its activations, and
    rank 2 in ``recv`` for rank 0's. Rank 0 holds up rank 2 only because it waits in the pair: naming
    it would cordon a healthy node. Exported from every rank; the pipeline's test below runs with the
    pod sidecar, so that each exporter's point-to-point waits are read by the rules once."""
    with _stack(tmp_path, "late", world=4, step=30, steps=200, script=PARALLEL_SCRIPT,
                extra=["--late-s", "30"]) as (webhook, training, prometheus):
        fired, live = _late_rank_one(webhook, training, prometheus, "CommlensRankLate",
                                     'commlens_p2p_hung_seconds{rank="3"}', "rank 3 waiting for rank 1")
    assert {rank for _, rank in fired} == {"1"}, fired
    assert "late or missing: rank 1 " in live and culprits(live) == {1}, live
    assert "rank 3 waits on it in recv (group 6)" in live, live
    offline = _diagnose(str(training.out))
    assert "late or missing: rank 1 " in offline and culprits(offline) == {1}, offline


def test_a_pipeline_stage_late_on_its_send_is_named_and_the_stages_waiting_in_recv_are_not(tmp_path):
    """Rank 1, of the pipeline's first stage, sends its activations 30 s late in a step that ends with
    the job's loss all_reduce (``tests/parallel_train.py``): rank 3 waits in ``recv`` for it, and ranks
    0 and 2 wait in the loss all_reduce for both. Rank 3 is behind there only because it waits on its
    peer. With the pod sidecar (the test above exports from every rank). About 70 s: the late send
    must outlast the hang threshold, the alert's ``for`` and Alertmanager's hand-off, and the job must
    then finish for its files to be read."""
    with _stack(tmp_path, "late-send", world=4, step=30, steps=200, script=PARALLEL_SCRIPT, pod=True,
                extra=["--late-s", "30"]) as (webhook, training, prometheus):
        fired, live = _late_rank_one(webhook, training, prometheus, "CommlensPeerLate",
                                     'commlens_collective_hung_seq{rank="2"}', "rank 2 waiting for rank 1")
        peer = [a["labels"] for a in webhook.alerts if a["labels"]["alertname"] == "CommlensPeerLate"]
    assert {rank for _, rank in fired} == {"1"}, fired
    assert peer[0]["waiter"] == "3" and peer[0]["op"] == "recv", peer
    assert "is being deprecated" not in training.log.read_text()  # commlens asks torch nothing it deprecates
    assert culprits(live) == {1}, live
    assert "late or missing: rank 1 in recv (group 6) — rank 3 waits on it in recv (group 6)" in live, live
    assert "rank 3 is behind too, but waits itself on rank 1 in recv (group 6)" in live, live
    offline = _diagnose(str(training.out))
    assert "late or missing: rank 1 " in offline and culprits(offline) == {1}, offline


def test_the_jobs_start_up_is_no_fault_after_the_fact_and_the_rank_late_later_is_named_alone(tmp_path):
    """A pipeline of 4 stages (``tests/matrix_train.py --layout pp4``) whose rank 1 builds its model 5 s
    after the others have begun training (a slower disk): ranks 0 and 2 wait past the hang threshold in
    their first ``send`` and ``recv`` to and from it, before it has begun any op, and rank 3 on rank 2.
    Rank 3, the last stage, is late at step 10: after the fact it alone is named, not the rank that
    started last nor a stage that waited on it (their waits are the job's start-up)."""
    with TrainingJob(tmp_path, 4, "late", rank=3, step=10, steps=40, script=MATRIX_SCRIPT,
                     extra=["--layout", "pp4", "--slow-start", "1"]) as training:
        assert training.wait(180) == 0
    spans = [(int(span["startTimeUnixNano"]), a) for span, a in spans_in(str(training.out))]
    began = min(start for start, a in spans if a[names.RANK] == 1)
    assert any(a.get(names.HANG) and a.get(names.PEER) == 1 for start, a in spans if start < began)
    offline = _diagnose(str(training.out))
    assert "late or missing: rank 3 " in offline and culprits(offline) == {3}, offline


def test_a_stall_is_named_where_the_late_ranks_own_part_was_a_slow_outlier_too():
    """Facts of a CI run on a loaded host: rank 0 waited 1.5 s in its pair's all_reduce for rank 1, whose
    own part took 29 ms, several times its usual and so flagged slow too. Rank 1 is named, rank 0 not."""
    facts = [RankFacts(rank) for rank in range(2)]
    start = 10**12
    for f in facts:
        group = f.group("1")
        group.issued = 40
        group.arrivals = {seq: ("all_reduce", start + seq * 10**7) for seq in range(1, 41)}
    facts[0].group("1").slow_waits[31] = ("all_reduce", start, start + 1_504_000_000)
    facts[1].group("1").slow_waits[31] = ("all_reduce", start + 1_475_000_000, start + 1_504_000_000)
    found = findings(facts)
    assert [(f.kind, f.ranks, f.seq) for f in found] == [("stall", (1,), 31)], found
    assert found[0].evidence.startswith("ranks [0] waited 1.5 s in it, ")


def test_a_pipeline_stage_that_paused_once_is_named_a_stall_and_the_stages_waiting_on_it_are_not():
    """Facts of a 4-stage pipeline (group 1) whose stage 2 paused 1.5 s once, under the hang threshold:
    stages 1 and 3 waited on it in ``recv`` (slow outliers), and stage 0 on stage 1, which was waiting
    itself. Stage 2 alone is named, once, with the waits on it; with stage 2 waiting on stage 3 all the
    while (the pause was stage 3's), stage 3 is named instead."""
    ms = 1_000_000

    def facts(pause_by: int) -> list[RankFacts]:
        stages = [RankFacts(rank) for rank in range(4)]
        start = 10**12
        waits = {1: (2, 5 * ms), 3: (2, 2 * ms), 0: (1, 9 * ms)} if pause_by == 2 else \
            {2: (3, 5 * ms), 1: (2, 8 * ms), 0: (1, 9 * ms)}
        for rank, (peer, late) in waits.items():
            wait = (start + late, start + 1_500 * ms, "recv", peer)
            stages[rank].group("1").p2p_slow_waits.append(wait)
            stages[rank].waits[wait[0]] = wait[1]
        return stages

    found = findings(facts(2))
    assert [(f.kind, f.ranks, f.op) for f in found] == [("stall", (2,), "recv")], [f.line() for f in found]
    assert found[0].evidence.startswith("ranks [1, 3] waited 1.5 s on it in recv, "), found[0].evidence
    found = findings(facts(3))
    assert [(f.kind, f.ranks) for f in found] == [("stall", (3,))], [f.line() for f in found]


def test_a_one_off_stall_under_the_hang_threshold_is_named_after_the_fact_and_only_its_rank(tmp_path):
    """Rank 1 stalls 1.5 s once (a GC pause, a checkpoint write), under the 3 s hang threshold, before
    its pair's all_reduce (``tests/parallel_train.py``): rank 0 waits for it there, ranks 2 and 3 in
    ``recv``. No hang, so nothing is pending past it; from the job's files, ``commlens diagnose``
    names the stall, with its rank, collective and cost, and not the ranks it held up. No alert names
    anyone else (the straggler rule may name rank 1: it did arrive late)."""
    with _stack(tmp_path, "late", world=4, step=30, steps=200, script=PARALLEL_SCRIPT,
                extra=["--late-s", "1.5"]) as (webhook, training, prometheus):
        assert training.wait(120) == 0, training.log.read_text()[-3000:]
        named = {a["labels"].get("rank", a["labels"].get("node")) for a in webhook.alerts if a["labels"]["alertname"] in CULPRIT_ALERTS}
    assert named <= {"1"}, webhook.alerts
    offline = _diagnose(str(training.out))
    assert culprits(offline) == {1}, offline
    assert re.search(r"^stall: rank 1 in all_reduce \(group 1, seq \d+\) — ranks \[0\] waited 1\.\d s in it, .*"
                     r"while ranks \[1\] waited nowhere; the waits for it cost the job 1\.\d rank-seconds, "
                     r"\d+\.\d% of its time$", offline, re.MULTILINE), offline


@EXPORTERS
def test_a_rank_killed_inside_its_pairs_all_reduce_is_named_alive_and_after_the_job_from_its_files(tmp_path, pod):
    """Rank 1 SIGKILLs itself inside its tensor-parallel pair's all_reduce (``tests/parallel_train.py``):
    its partner's all_reduce fails, rank 3 waits in ``recv`` for it, and torchrun tears the job down
    within seconds. With the pod sidecar, which outlives the ranks and reads the killed rank's ring from
    shared memory, and with the in-process agent, killed with its rank (its endpoint gone without a word,
    no dump and no note that it ended): the alert names rank 1 and no other, and so does ``commlens
    diagnose`` from Prometheus once the job is gone, and from the job's files. Live, the collective is
    named as far as the scrapes saw rank 1 issue one: a rank killed before its first collective was
    scraped is named in "a collective" of the default group, and nothing more is claimed. About 40 s
    each."""
    with _stack(tmp_path, "kill", world=4, step=100, steps=300, script=PARALLEL_SCRIPT, pod=pod) as (
            webhook, training, prometheus):
        wait_for(lambda: webhook.firing("CommlensRankKilled"), "CommlensRankKilled at the webhook", timeout_s=90,
                 explain=lambda: _evidence(prometheus, training))
        assert training.wait(120) != 0  # torchrun reports the killed rank
        live = _diagnose("--prometheus", f"http://127.0.0.1:{prometheus.port}")
        scraped = prometheus.query(f'last_over_time({names.LAST_SEQ}{{rank="1", state="enqueued"}}[15m])')
        named = {a["labels"].get("rank", a["labels"].get("node")) for a in webhook.alerts if a["labels"]["alertname"] in CULPRIT_ALERTS
                 or a["labels"]["alertname"] == "CommlensRankKilled"}
    assert named == {"1"}, webhook.alerts
    offline = _diagnose(str(training.out))
    # live, the op is known only where rank 0's failure in it was scraped before the teardown; without a
    # pod sidecar, the collective it died in is where its peers failed on it (its partner may have
    # completed the pair's all_reduce and failed next in the job's loss)
    group = r"group 1, seq " if pod else r"group \d+, seq " if scraped else r"group 0\)"
    assert re.search(rf"killed or crashed: rank 1 in (all_reduce|a collective) \({group}", live) \
        and culprits(live) == {1}, live
    # after the fact without a pod sidecar, where torchrun signalled its partner before that all_reduce failed
    # on it or was issued (the dumps say so), the ops seen waiting on it are a later stage's recv
    where = rf"all_reduce \({group}" if pod else rf"(all_reduce \({group}|a point-to-point op \(group \d+\))"
    assert re.search(rf"killed or crashed: rank 1 in {where}", offline) and culprits(offline) == {1}, offline


def test_a_rank_whose_input_size_differs_is_named_live_and_from_the_dumps_and_no_other_rank_is(tmp_path):
    """Rank 1 gives the job's loss all_reduce two elements where the others give one
    (``tests/parallel_train.py``, a shape bug in one rank's code): gloo completes the others and leaves
    rank 1 waiting, its pair partner waiting on it, until gloo's timeout fails them and torchrun tears
    the job down. Live, the alert and ``commlens diagnose --prometheus`` name rank 1, left in a collective
    its group completed, and no deadlock. With the pod sidecar, whose dumps hold every rank's inputs, even
    a killed one's: ``commlens diagnose`` on the job's files names rank 1 and its input, and no other rank
    (their failures follow from it), as ``torchfrtrace`` does. Live, rank 1 stays named once gloo's
    timeout (20 s) has failed its wait, as its partners' ops fail and the job ends: read again then, and
    no alert says deadlock or hang (CI's loaded host read it that late, and both did). The live reading
    is one instant's state, however long a loaded host takes over its queries; a rank sending to one
    that gloo failed waits it out before the job ends."""
    with _stack(tmp_path, "size", world=4, step=30, steps=200, script=PARALLEL_SCRIPT, pod=True, query_log=True,
                extra=["--timeout-s", "20"]) as (
            webhook, training, prometheus):
        wait_for(lambda: webhook.firing("CommlensCollectiveMismatch"), "CommlensCollectiveMismatch at the webhook",
                 explain=lambda: _evidence(prometheus, training))
        asked = len(prometheus.queries())
        live = _diagnose("--prometheus", f"http://127.0.0.1:{prometheus.port}")
        reading = prometheus.queries()[asked:]
        wait_for(lambda: prometheus.query(f'{names.FAILED_SEQ}{{rank="1", pg="0"}}'), "rank 1's wait failed by gloo",
                 explain=lambda: _evidence(prometheus, training))
        failed = _diagnose("--prometheus", f"http://127.0.0.1:{prometheus.port}")
        assert training.wait(120) != 0  # the backend ended it
        wait_for(lambda: all((training.out / f"rank_{rank}").exists() for rank in range(4)), "every rank's dump")
        named = {a["labels"].get("rank", a["labels"].get("node")) for a in webhook.alerts if a["labels"]["alertname"] in CULPRIT_ALERTS
                 or a["labels"]["alertname"] == "CommlensRankKilled"}
    assert named == {"1"}, webhook.alerts
    assert not {a["labels"]["alertname"] for a in webhook.alerts} & {"CommlensDeadlock", "CommlensCollectiveHung"}, \
        webhook.alerts
    for verdict in (live, failed):
        assert culprits(verdict) == {1} and "size mismatch: rank 1 in all_reduce (group 0, seq " in verdict, verdict
    assert len(reading) > 20 and len({(q["start"], q["end"]) for q in reading}) == 1, reading
    offline = _diagnose(str(training.out))
    assert culprits(offline) == {1}, offline
    assert re.search(r"^size mismatch: rank 1 in all_reduce \(group 0, seq \d+\) — its input was Float\[2\] where "
                     r"ranks \[0, 2, 3\] gave Float\[\]$", offline, re.MULTILINE), offline
    analyzer = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(training.out)],
                              capture_output=True, text=True, timeout=120)
    found = analyzer.stdout + analyzer.stderr
    assert "Culprit rank 1; Error type: SIZE_OR_SYNTAX_MISMATCH" in found, found[-3000:]


@pytest.mark.parametrize("op, ours, theirs, named", [
    ("all_reduce", "Float[4]", "Float[8]", {2}), ("all_gather", "Float[4]", "Float[8]", set()),
    ("all_gather", "Float[4]", "Half[4]", {2}), ("scatter", "", "Float[3, 4]", set())],
    ids=["all_reduce-size", "all_gather-uneven", "all_gather-dtype", "scatter-root"])
def test_inputs_that_differ_are_a_size_mismatch_where_the_op_needs_them_alike(op, ours, theirs, named):
    """Rank 2's input differs from ranks 0 and 1's in one collective of the dumps: in size, a mismatch
    for all_reduce and not for all_gather (whose inputs may be uneven); in dtype, for any op; a scatter's
    root alone gives inputs, and is no mismatch."""
    facts = [RankFacts(rank) for rank in range(3)]
    for f in facts:
        f.group("0").inputs[5] = (op, theirs if f.rank == 2 else ours)
    assert {rank for f in findings(facts) if f.kind == "size_mismatch" for rank in f.ranks} == named


def test_a_rank_left_waiting_in_a_collective_its_group_completed_is_a_size_mismatch_not_a_deadlock():
    """Live facts of the size fault above: rank 1 waits in seq 4 of group 0 that ranks 0, 2, 3 completed,
    and rank 0 waits on rank 1 in their pair. Rank 1 is named, as a size mismatch; while rank 3, gone,
    had completed only seq 3, a late rank may yet explain the wait and nothing of the kind is said."""
    facts = [RankFacts(rank) for rank in range(4)]
    for f in facts:
        f.group("0").issued, f.group("0").finished = 4, 4
    facts[1].group("0").finished, facts[1].group("0").hung = 3, ("all_reduce", 4)
    facts[0].group("1").issued, facts[0].group("1").finished, facts[0].group("1").hung = 32, 31, ("all_reduce", 32)
    facts[1].group("1").issued = facts[1].group("1").finished = 31
    found = findings(facts)
    assert [(f.kind, f.ranks, f.pg, f.seq) for f in found] == [("size_mismatch", (1,), "0", 4)], found
    assert "ranks [0, 2, 3] completed it and rank 1 waited past the hang threshold in it" in found[0].evidence
    facts[3].gone, facts[3].group("0").finished = True, 3
    assert not any(f.kind == "size_mismatch" for f in findings(facts))
    facts[3].gone, facts[3].group("0").finished = False, 4
    facts[1].group("0").finished = 5  # a wait at start-up it has since come out of: no finding
    assert not any(f.kind == "size_mismatch" for f in findings(facts))


def test_ranks_that_issue_two_groups_collectives_in_different_orders_are_a_deadlock_and_none_is_named_late(tmp_path):
    """Rank 1 issues the job's loss all_reduce before its pair's (``tests/parallel_train.py``): it
    waits there for the others, which wait for it and for each other in the pairs and the
    data-parallel groups. No rank is late: every rank behind waits itself. One exporter only: the
    rules and the detectors read the same series as in the tests above, whichever exporter serves them."""
    with _stack(tmp_path, "order", world=4, step=30, steps=200, script=PARALLEL_SCRIPT) as (
            webhook, training, prometheus):
        wait_for(lambda: webhook.firing("CommlensDeadlock"), "CommlensDeadlock at the webhook", timeout_s=90,
                 explain=lambda: _evidence(prometheus, training))
        live = _diagnose("--prometheus", f"http://127.0.0.1:{prometheus.port}")
        fired = {a["labels"]["alertname"] for a in webhook.alerts if a["status"] == "firing"}
    assert fired == {"CommlensDeadlock"}, webhook.alerts
    assert "deadlock: waiting on each other, ranks 0, 1, 2, 3 " in live and "late or missing" not in live, live


def test_two_pipeline_stages_that_both_receive_first_are_a_deadlock_named_with_their_point_to_point_waits(tmp_path):
    """Rank 1, of the pipeline's first stage, receives from rank 3 before it sends (a schedule's bug): both
    wait in ``recv`` on each other, and the others wait for them in the next collectives. The alert and
    ``commlens diagnose`` name ranks 1 and 3 as a deadlock, with the point-to-point waits as evidence,
    and no rank as late. About 25 s."""
    with _stack(tmp_path, "recv-first", world=4, step=30, steps=200, script=PARALLEL_SCRIPT) as (
            webhook, training, prometheus):
        wait_for(lambda: webhook.firing("CommlensDeadlock"), "CommlensDeadlock at the webhook", timeout_s=90,
                 explain=lambda: _evidence(prometheus, training))
        live = _diagnose("--prometheus", f"http://127.0.0.1:{prometheus.port}")
        fired = {(a["labels"]["alertname"], a["labels"]["rank"]) for a in webhook.alerts
                 if a["labels"]["alertname"] in CULPRIT_ALERTS and a["status"] == "firing"}
    assert fired == {("CommlensDeadlock", "1"), ("CommlensDeadlock", "3")}, webhook.alerts
    assert "deadlock: waiting on each other, ranks 1, 3 " in live and "late or missing" not in live, live
    assert "rank 1 waits itself on rank 3 in recv (group 6)" in live, live
    assert "rank 3 waits itself on rank 1 in recv (group 6)" in live, live


@pytest.mark.long
def test_a_healthy_run_fires_nothing_and_leaves_nothing_pending(tmp_path):
    """The 4-rank script of pairs, pipeline stages, DDP and the job's loss (``tests/parallel_train.py``),
    in mixed precision with dynamic loss scaling (every few steps the scaled gradients overflow: Inf in
    every rank's gradient buckets, and the scaler skips the step), in 60 ms steps, watched for 40 s:
    longer than every rule's 10 s windows and every ``for`` but the loss scaler's, the bandwidth drop's
    and a target down's (a minute and more, none of them pending either), so that the rules run over
    the healthy pipeline's waits and overflows many times. The suite's
    longest test (started first); with the pod sidecar (the per-rank exporter serves the same series:
    its healthy job is the matrix sample's FSDP2 one). 60 ms steps, not 20: the same watch at about
    half the CPU, on cores the other tests share. On the way an operator takes a snapshot (``commlens
    dump``): every rank writes its dump (from shared memory), and the job trains on and stays healthy."""
    world = 4
    with _stack(tmp_path, "none", world=world, steps=1100, script=PARALLEL_SCRIPT,
                extra=["--step-ms", "60", "--amp"], pod=True) as (webhook, training, prometheus):
        wait_for(lambda: prometheus.query("commlens:collective_wait_seconds:mean10s"), "the first recording")
        asked = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "dump", "--store", training.store,
                                "--job-id", "verdict-test"], capture_output=True, text=True, timeout=60)
        assert asked.returncode == 0 and "asked every rank of job 'verdict-test'" in asked.stdout, asked
        dumps = [training.out / f"rank_{rank}" for rank in range(world)]
        wait_for(lambda: all(dump.exists() for dump in dumps), "every rank's dump", timeout_s=30)
        wait_for(lambda: prometheus.by_rank('commlens_abort_snapshots_total{reason="peer"}') ==
                 {rank: 1.0 for rank in range(world)}, "one snapshot on demand counted by every rank")
        started = time.monotonic()
        while time.monotonic() - started < 40 and training.process.poll() is None:
            time.sleep(1)  # not synchronisation: the healthy run lasts this long while the rules evaluate
        assert training.process.poll() is None, "the job ended before the watch did: give it more steps"
        pending = prometheus.query('max_over_time(count_over_time(ALERTS{alertstate="pending"}[3s])[5m:1s])')
        firing = prometheus.query('ALERTS{alertstate="firing"}')
        skipped = prometheus.by_rank('commlens_loss_scale_steps_total{outcome="skipped"}')
        infs = prometheus.by_rank('sum by (rank) (commlens_nan_events_total{kind="inf"})')
        live = _diagnose("--prometheus", f"http://127.0.0.1:{prometheus.port}")
        # a healthy job ends on its own: stopped by the test instead, a rank's last collective fails
        # (its peer is gone), and the files would rightly show that
        assert training.wait(600) == 0, _evidence(prometheus, training)
        offline_files = training.out
    assert not webhook.alerts and not firing, (webhook.alerts, firing)
    assert all(float(p["value"][1]) <= 1 for p in pending), pending
    # the overflows were there, and counted: skipped steps on every rank, Inf in their collectives
    assert sorted(skipped) == list(range(world)) and min(skipped.values()) >= 10, skipped
    assert sorted(infs) == list(range(world)) and min(infs.values()) >= 10, infs
    offline = _diagnose(str(offline_files))
    for report in (live, offline):  # live, each line starts with the job's name
        first, *notes = report.splitlines()
        assert first.endswith("nothing wrong found") and len(notes) == 1, report
        assert "no fault: the loss scaler skipped " in notes[0], report
        assert notes[0].endswith("(ranks 0, 1, 2, 3): its overflow"), report
    for dump in dumps:  # written while the job trained: its collectives, the all_reduces among them
        assert any(e["profiling_name"].endswith("all_reduce") for e in pickle.loads(dump.read_bytes())["entries"])


def test_a_rank_still_waiting_in_the_groups_previous_collective_is_held_up_not_named():
    """Live facts of a 4-rank DDP job whose rank 1 left its loop after seq 17: ranks 0 and 2 wait in seq
    20, and rank 3 still waits in the broadcast of seq 19, which gloo relays through rank 1. Rank 3 is
    behind in seq 20 only because it waits on rank 1 in seq 19: rank 1 alone is named."""
    facts = [RankFacts(rank) for rank in range(4)]
    states = ((20, 19, ("all_reduce", 20)), (17, 17, None), (20, 19, ("all_reduce", 20)), (19, 18, ("broadcast", 19)))
    for f, (issued, finished, hung) in zip(facts, states):
        f.group("0").issued, f.group("0").finished, f.group("0").hung = issued, finished, hung
    facts[1].gone = True
    found = findings(facts)
    assert [(f.kind, f.ranks, f.seq) for f in found] == [("late_rank", (1,), 20)], found
    assert "rank 3 is behind too, but waits itself in broadcast (group 0) seq 19, which rank 1 has not issued" \
        in found[0].evidence


def _write_spans(path: pathlib.Path, spans: list[tuple[int, str, int, int, int]], **attributes) -> None:
    """An OTLP JSON-lines trace file of all_reduce spans of a job of 4: (rank, group, seq, start ns, end
    ns) each, with ``attributes`` (``names``' attribute names) on every span."""
    def attribute(key, value):
        return {"key": key, "value": {"intValue": str(value)} if isinstance(value, int) else {"stringValue": value}}

    lines = [{"resourceSpans": [{"scopeSpans": [{"spans": [
        {"name": "all_reduce", "startTimeUnixNano": str(start), "endTimeUnixNano": str(end), "attributes": [
            attribute(key, value) for key, value in {names.RANK: rank, names.WORLD_SIZE: 4, names.SEQ: seq,
                                                     names.OP: "all_reduce", names.PG_NAME: pg, **attributes}.items()]}]}]}]}
        for rank, pg, seq, start, end in spans]
    with path.open("a") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))


def test_after_the_fact_a_straggler_is_named_by_its_own_compute_and_the_ranks_it_held_up_are_not(tmp_path):
    """Spans of 4 ranks in tensor-parallel pairs (0, 1) and (2, 3) (groups 1, 2) and data-parallel pairs
    (0, 2) and (1, 3) (groups 3, 4), 40 steps of 100 ms: rank 3 computes 60 ms longer than the others
    before its pair's all_reduce, where rank 2 waits for it; rank 2 then comes 60 ms late to its
    data-parallel all_reduce, where rank 0 waits for it. Rank 2 arrives last there because it waited
    for rank 3: it spends 61 % of its time in collectives, rank 3 2 %. Rank 3 alone is named."""
    ms, spans = 1_000_000, []
    for step in range(40):
        t0 = 10**18 + step * 100 * ms
        tp_end = {0: t0 + 21 * ms, 1: t0 + 21 * ms, 2: t0 + 81 * ms, 3: t0 + 81 * ms}
        arrive = {0: t0 + 20 * ms, 1: t0 + 20 * ms, 2: t0 + 20 * ms, 3: t0 + 80 * ms}
        for rank in range(4):
            spans.append((rank, str(1 + rank // 2), step + 1, arrive[rank], tp_end[rank]))
        for pair, group in (((0, 2), "3"), ((1, 3), "4")):
            starts = {rank: tp_end[rank] + 9 * ms for rank in pair}
            for rank in pair:
                spans.append((rank, group, step + 1, starts[rank], max(starts.values()) + ms))
    for rank in range(4):
        _write_spans(tmp_path / f"traces-{rank}.jsonl", [span for span in spans if span[0] == rank])
    found = findings(from_files(str(tmp_path), on_problem=pytest.fail))
    assert {(f.kind, f.ranks) for f in found} == {("straggler", (3,))}, [f.line() for f in found]


@pytest.mark.parametrize("ended", [False, True], ids=["killed", "ended"])
def test_a_rank_killed_without_a_pod_sidecar_is_named_from_the_dump_and_note_it_did_not_leave(tmp_path, ended):
    """The files of a 4-rank job of tensor-parallel pairs (groups 1, 2) run with the in-process agent: rank
    2 is killed inside its pair's all_reduce seq 31, whose span it never exported; rank 3's fails there,
    and torchrun stops ranks 0, 1 and 3, whose dumps say they were signalled. Rank 2 left no dump and no
    note that it ended: it is named killed in seq 31, where rank 3 failed; a job folder where it had
    ended on its own (its note) names nobody killed."""
    ms, t0 = 1_000_000, 10**18
    for rank in range(4):
        spans = [(rank, str(1 + rank // 2), seq, t0 + seq * 20 * ms, t0 + seq * 20 * ms + ms) for seq in range(1, 31)]
        _write_spans(tmp_path / f"traces-{rank}.jsonl", spans)
    _write_spans(tmp_path / "traces-3.jsonl", [(3, "2", 31, t0 + 620 * ms, t0 + 621 * ms)], **{names.STATUS: "error"})
    for rank in (0, 1, 3):
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps({"version": "2.10", "entries": [], "commlens_reasons":
                                                              ["signal"], "commlens_signalled_ns": t0 + 700 * ms}))
    if ended:
        (tmp_path / "ended-2.json").write_text(json.dumps({"rank": 2, "ended_ns": t0 + 610 * ms}))
    lines = [f.line() for f in findings(from_files(str(tmp_path), on_problem=pytest.fail))]
    if ended:
        assert not any(line.startswith("killed or crashed") for line in lines), lines
    else:
        assert lines == ["killed or crashed: rank 2 in all_reduce (group 2, seq 31) — its process left no dump and "
                         "no note that it ended, where the others left theirs (SIGKILL, the OOM killer, a crash); "
                         "ranks [3] waited in or failed in seq 31"], lines


def test_a_nan_sent_over_the_pipeline_is_named_where_it_entered_and_not_where_it_reached():
    """Metrics of an 8-rank job (pairs, pipeline groups 6 and 7, data-parallel groups): rank 5 sends NaN
    to rank 3 (its 4th send to it, group 6); rank 3, which had issued 4 recvs from rank 5, gives it to
    its pair's all_reduce (group 2, seq 31), whose output reaches rank 2 (its entry at seq 32 of group
    2), which sends it on to rank 0 (group 6), whose entry is then its data-parallel all_reduce. Each
    of them saw NaN first in a group of its own: judged by group, four origins. Rank 5 alone is named,
    with the way the values went."""
    texts = {
        5: ['commlens_nonfinite_first_send{pg="6",peer="3",kind="nan",rank="5"} 4',
            'commlens_nonfinite_entry_seq{pg="6",op="send",kind="nan",peer="3",rank="5"} 7',
            'commlens_nonfinite_issued_before_seq{pg="3",peer="",rank="5"} 30'],
        3: ['commlens_nonfinite_first_seq{pg="2",op="all_reduce",kind="nan",rank="3"} 31',
            'commlens_nonfinite_entry_seq{pg="2",op="all_reduce",kind="nan",peer="",rank="3"} 31',
            'commlens_nonfinite_issued_before_seq{pg="2",peer="",rank="3"} 30',
            'commlens_nonfinite_issued_before_seq{pg="6",peer="5",rank="3"} 4'],
        2: ['commlens_nonfinite_first_seq{pg="2",op="all_reduce",kind="nan",rank="2"} 32',
            'commlens_nonfinite_first_send{pg="6",peer="0",kind="nan",rank="2"} 9',
            'commlens_nonfinite_entry_seq{pg="2",op="all_reduce",kind="nan",peer="",rank="2"} 32',
            'commlens_nonfinite_issued_before_seq{pg="2",peer="",rank="2"} 31'],
        0: ['commlens_nonfinite_first_seq{pg="3",op="all_reduce",kind="nan",rank="0"} 40',
            'commlens_nonfinite_entry_seq{pg="3",op="all_reduce",kind="nan",peer="",rank="0"} 40',
            'commlens_nonfinite_issued_before_seq{pg="3",peer="",rank="0"} 39',
            'commlens_nonfinite_issued_before_seq{pg="6",peer="2",rank="0"} 9'],
    }
    scrape = ["\n".join(lines) + "\n" for lines in texts.values()]
    found = findings(from_metrics_texts(scrape, scrape, 5.0))
    assert [f.line() for f in found] == [
        "NaN/Inf entered on rank 5 in send (group 6, seq 7) — its input to rank 3 held NaN before any non-finite "
        "value reached it; it reached rank 0 (a recv from rank 2 in group 6), rank 2 (the output of group 2's seq "
        "31, whose input held it on rank 3), rank 3 (a recv from rank 5 in group 6)"]



def test_the_ranks_a_nan_reached_the_same_way_are_said_once_as_runs():
    """Metrics of a 64-rank job: rank 40's input to world all_reduce 1000 held NaN; the other 63 saw it
    first in 1001, having issued 1000 (its output): one way, said once, not 63 times."""
    def rank(r: int, seq: int) -> str:
        return (f'commlens_nonfinite_first_seq{{pg="0",op="all_reduce",kind="nan",rank="{r}"}} {seq}\n'
                f'commlens_nonfinite_entry_seq{{pg="0",op="all_reduce",kind="nan",peer="",rank="{r}"}} {seq}\n'
                f'commlens_nonfinite_issued_before_seq{{pg="0",peer="",rank="{r}"}} {seq - 1}\n')
    scrape = [rank(r, 1000 if r == 40 else 1001) for r in range(64)]
    assert [f.line() for f in findings(from_metrics_texts(scrape, scrape, 5.0))] == [
        "NaN/Inf entered on rank 40 in all_reduce (group 0, seq 1000) — its input held NaN before any non-finite "
        "value reached it; it reached ranks 0-39, 41-63 (the output of group 0's seq 1000, whose input held it on "
        "rank 40)"]

@pytest.mark.parametrize("seen", [False, True], ids=["unseen", "seen"])
def test_a_rank_whose_own_endpoint_went_down_without_a_word_while_its_partner_waits_was_killed(seen):
    """Live facts, in-process agents: rank 1's endpoint is down, its last scrapes said nothing of how its
    process ended, and rank 0 waits in seq 31 of their pair (group 1). Killed before its first collective
    was scraped (a rank OOM-killed in its first step), its groups are not known: it may be in any. Seen in
    group 1 up to seq 30, it is behind there. Either way it is named killed, and nobody else."""
    facts = [RankFacts(rank) for rank in range(4)]
    for f in facts:
        f.group("0").issued = f.group("0").finished = 3
    facts[0].group("1").issued, facts[0].group("1").finished, facts[0].group("1").hung = 31, 30, ("all_reduce", 31)
    facts[1].vanished = facts[1].unreachable = facts[1].gone = True
    if not seen:
        facts[1].groups.clear()
    else:
        facts[1].group("1").issued = facts[1].group("1").finished = 30
    lines = [f.line() for f in findings(facts)]
    assert lines == ["killed or crashed: rank 1 in all_reduce (group 1, seq 31) — its metrics endpoint went down with "
                     "no word of how its process ended (SIGKILL, the OOM killer, a crash); ranks [0] waited in or failed "
                     "in seq 31"], lines
    facts[0].group("1").hung = None  # nobody waits on it: it vanished, and is not known to have died
    assert not [f.line() for f in findings(facts)]


@pytest.mark.parametrize("seen", [False, True], ids=["unseen", "seen"])
def test_a_rank_that_vanished_as_torchrun_tore_the_job_down_is_named_killed_and_the_teardowns_failures_are_not(seen):
    """Live facts of a TP x DP job (pairs 0-1 and 2-3 in groups 1 and 2, replicas 0-2 and 1-3 in groups 3
    and 4) whose rank 1 was SIGKILLed inside its pair's all_reduce (seq 21): torchrun told the others to
    stop within a scrape. Rank 0 had that all_reduce in flight (unseen: nobody was scraped waiting), or
    failed in it (seen); rank 2's next all_reduce with rank 0 (group 3, seq 26) failed as rank 0's
    process ended. Rank 1 is named killed, and nobody else: rank 0, behind in group 3, was stopped."""
    facts = [RankFacts(rank) for rank in range(4)]
    for f in facts:
        f.group("0").issued = f.group("0").finished = 2
        f.gone = f.unreachable = True
        f.stopped = f.rank != 1
    facts[1].vanished = True
    facts[1].groups.clear()  # killed before its metrics were first scraped
    facts[0].group("1").issued, facts[0].group("1").finished = 21, 20
    facts[0].group("3").issued = facts[0].group("3").finished = 25
    facts[2].group("3").issued = facts[2].group("3").finished = 26
    facts[2].group("2").issued = facts[3].group("2").issued = 21
    facts[3].group("4").issued = facts[3].group("4").finished = 25
    if seen:
        facts[0].group("1").failed, facts[2].group("3").failed = ("all_reduce", 21), ("all_reduce", 26)
        facts[1].group("1").issued = facts[1].group("1").finished = 20
    lines = [f.line() for f in findings(facts)]
    assert len(lines) == 1 and lines[0].startswith("killed or crashed: rank 1 in "), lines
    # unseen: the collective rank 0 was still in when told to stop (its op is not in the metrics)
    assert ("in all_reduce (group 1, seq 21)" if seen else "in a collective (group 1, seq 21) —") in lines[0], lines
    for f in facts[::2] + facts[3:]:
        f.stopped = False  # nobody told to stop: it vanished while the others carried on, not known to have died
    assert not [f.line() for f in findings(facts) if not seen]


def test_a_rank_that_vanished_where_torchrun_signalled_the_others_before_any_saw_it_die_is_named_after_the_fact():
    """Facts from the files of a 4-stage pipeline (stages in group 1 ops, the job's loss all_reduce in
    group 0) whose last stage, rank 3, was SIGKILLed inside the loss all_reduce (seq 3): torchrun
    signalled the others 30 ms later, before any op failed on it. Ranks 1 and 2 were still in that
    all_reduce, rank 0 had not issued it; each left a dump written on the signal, rank 3 nothing. Rank 3
    is named killed in it, and nobody else; had nobody been signalled, it is not known to have died."""
    facts = [RankFacts(rank) for rank in range(4)]
    for f in facts:
        f.group("0").issued, f.group("0").finished = (3, 2) if f.rank in (1, 2) else (2, 2)
        f.group("1").issued = f.group("1").finished = 20
        f.signalled_ns = None if f.rank == 3 else 1_000 + f.rank
    facts[3].vanished = True
    facts[3].group("0").finished = facts[3].group("1").finished = None  # its spans end before
    lines = [f.line() for f in findings(facts)]
    assert len(lines) == 1 and lines[0].startswith("killed or crashed: rank 3 in a collective (group 0, seq 3)"), lines
    for f in facts:
        f.signalled_ns = None
    assert not findings(facts)


def test_a_group_that_hangs_with_nobody_behind_while_a_rank_vanished_unseen_in_it_is_no_hang():
    """Live facts of the same TP x DP job: rank 1 was scraped once, in its pair (group 1) only, before
    it was killed there (seq 21, where rank 0 failed); rank 3 waits past the hang threshold in its
    data-parallel all_reduce with rank 1 (group 4, seq 26), in which rank 1 was never seen. Rank 1 is
    named killed; group 4's wait is no hang with no culprit."""
    facts = [RankFacts(rank) for rank in range(4)]
    facts[1].vanished = facts[1].unreachable = facts[1].gone = True
    facts[1].group("1").issued = facts[1].group("1").finished = 3
    facts[0].group("1").issued, facts[0].group("1").finished, facts[0].group("1").failed = 21, 20, ("all_reduce", 21)
    facts[3].group("4").issued, facts[3].group("4").finished, facts[3].group("4").hung = 26, 25, ("all_reduce", 26)
    lines = [f.line() for f in findings(facts)]
    assert len(lines) == 1 and lines[0].startswith("killed or crashed: rank 1 in all_reduce (group 1, seq 21)"), lines


def test_a_pipeline_stage_whose_peers_ops_with_it_failed_is_named_and_the_stage_that_failed_itself_is_not():
    """Live metrics of a pipeline of 4 stages (group 1) whose stage 2 left its loop: gloo fails rank 1's
    send to it and rank 3's recv from it at once, and rank 0 waits on rank 1 in its send. Rank 2 is named;
    rank 1, which rank 0 waits on, failed itself: a link of the chain."""
    lines = ['commlens_p2p_failed_seq{pg="1",op="send",peer="2",rank="1"} 40',
             'commlens_p2p_failed_seq{pg="1",op="recv",peer="2",rank="3"} 41',
             'commlens_p2p_hung_seconds{pg="1",op="send",peer="1",rank="0"} 5.5',
             'commlens_collective_last_seq{pg="0",state="enqueued",rank="2"} 3']
    scrape = ["\n".join(lines) + "\n"]
    found = [f.line() for f in findings(from_metrics_texts(scrape, scrape, 5.0))]
    assert found == ["late or missing: rank 2 in send (group 1) — rank 1's send with it failed (group 1); rank 3's "
                     "recv with it failed (group 1); it waits nowhere itself"], found


def test_a_killed_rank_whose_peers_failed_on_it_in_two_groups_is_named_once():
    """After the fact: rank 2 left no dump and no note; rank 3 failed on it in their pair's all_reduce
    (group 2, seq 31) and rank 0 in the job's loss all_reduce (group 0, seq 4). One finding, both waits."""
    facts = [RankFacts(rank) for rank in range(4)]
    for f in facts:
        f.group("0").issued = 4 if f.rank != 2 else 3
    facts[2].vanished = True
    facts[2].group("2").issued = 30
    facts[3].group("2").issued, facts[3].group("2").failed = 31, ("all_reduce", 31)
    facts[0].group("0").failed = ("all_reduce", 4)
    lines = [f.line() for f in findings(facts)]
    assert len(lines) == 1 and lines[0].startswith("killed or crashed: rank 2 in all_reduce (group 0, seq 4)"), lines
    assert lines[0].endswith("; in all_reduce (group 2, seq 31) too: ranks [3] waited in or failed in seq 31"), lines


def test_ranks_that_all_wait_in_a_collective_whose_input_is_larger_on_one_name_that_one_a_size_mismatch():
    """Live metrics of a 4-stage pipeline's job whose rank 0 gives the loss all_reduce 2 elements where
    the others give 1: gloo leaves every rank waiting in seq 3 (no rank behind, none completed it). Their
    hung collectives' bytes tell rank 0 apart: a size mismatch, not a hang with no culprit."""
    lines = [line for rank in range(4) for line in (
        f'commlens_collective_hung_seq{{pg="0",op="all_reduce",rank="{rank}"}} 3',
        f'commlens_collective_hung_bytes{{pg="0",op="all_reduce",rank="{rank}"}} {8 if rank == 0 else 4}',
        f'commlens_collective_last_seq{{pg="0",state="enqueued",rank="{rank}"}} 3',
        f'commlens_collective_last_seq{{pg="0",state="completed",rank="{rank}"}} 2')]
    scrape = ["\n".join(lines) + "\n"]
    found = [f.line() for f in findings(from_metrics_texts(scrape, scrape, 5.0))]
    assert found == ["size mismatch: rank 0 in all_reduce (group 0, seq 3) — its input was 8 bytes where ranks "
                     "[1, 2, 3] gave 4 bytes, and they wait in it: their sides did not match"], found


def test_a_rank_reached_by_an_inf_that_turned_nan_on_the_way_is_not_an_origin():
    """Live: rank 6's sends to rank 4 held Inf first (its 41st) and NaN later (its 43rd); rank 4 had
    issued 42 recvs from rank 6 before its own first non-finite input. The Inf reached it: rank 6 alone."""
    texts = ['commlens_nonfinite_first_send{pg="7",peer="4",kind="inf",rank="6"} 41\n'
             'commlens_nonfinite_first_send{pg="7",peer="4",kind="nan",rank="6"} 43\n'
             'commlens_nonfinite_entry_seq{pg="7",op="send",kind="inf",peer="4",rank="6"} 82\n',
             'commlens_nonfinite_first_seq{pg="9",op="all_reduce",kind="inf",rank="4"} 21\n'
             'commlens_nonfinite_entry_seq{pg="9",op="all_reduce",kind="inf",peer="",rank="4"} 21\n'
             'commlens_nonfinite_issued_before_seq{pg="7",peer="6",rank="4"} 42\n']
    found = findings(from_metrics_texts(texts, texts, 5.0))
    assert [(f.kind, f.ranks) for f in found] == [("nan_origin", (6,))], [f.line() for f in found]


def test_a_rank_behind_because_its_recv_from_the_culprit_failed_is_a_link_not_late():
    """Live: rank 0 left; rank 2's recv from it failed (group 5), so rank 2 never issued seq 21 of group 11,
    where rank 6 waits for it. Rank 0 is named; rank 2 is held up through it."""
    facts = [RankFacts(rank) for rank in (0, 2, 6)]
    facts[0].gone = True
    facts[1].group("5").p2p_failed = ("recv", 0, None)
    facts[1].group("11").issued = facts[1].group("11").finished = 20
    facts[2].group("11").issued, facts[2].group("11").finished, facts[2].group("11").hung = 21, 20, ("all_reduce", 21)
    lines = [f.line() for f in findings(facts)]
    assert culprits("\n".join(lines)) == {0}, lines
    assert any("rank 2 failed itself on rank 0 in recv (group 5)" in line for line in lines), lines


@pytest.mark.parametrize("live", [True, False])
def test_a_peer_the_job_s_teardown_stopped_is_not_late_for_the_op_with_it_that_failed(live):
    """Rank 3 was killed in its pair's all_reduce, which failed on rank 2; torchrun stopped the others
    (SIGTERM), and rank 5's recv from rank 7 failed as rank 7 ended. Rank 3 alone is named: rank 7 was told
    to stop (live: its snapshot said so; after the fact: its dump's signal time)."""
    facts = [RankFacts(rank) for rank in (2, 3, 5, 7)]
    facts[1].vanished = facts[1].gone = True
    facts[0].group("2").failed = ("all_reduce", 81)
    facts[0].group("2").issued = facts[1].group("2").issued = 81
    facts[2].group("8").p2p_failed = ("recv", 7, None if live else 2_000)
    if live:
        facts[3].stopped = facts[3].gone = True
    else:
        facts[3].signalled_ns = 1_500
    lines = [f.line() for f in findings(facts)]
    assert culprits("\n".join(lines)) == {3}, lines


def test_a_rank_waiting_on_a_peer_the_teardown_ended_while_it_waited_elsewhere_is_held_up_not_hung():
    """Live, 8 ranks in tensor x pipeline x data parallel: rank 3 left its loop; its pipeline peer rank 1's
    send failed on it and the job was torn down. Rank 4 waits in its data-parallel all_reduce with rank 0,
    which the teardown ended while it waited in its tensor-parallel pair with rank 1 (the matrix's
    tp-pp-dp:leave:pod:3, from its Prometheus): rank 4 is held up through rank 0, not a hang of its own."""
    facts = [RankFacts(rank) for rank in (0, 1, 3, 4)]
    for f in facts:
        f.gone = True
    facts[0].stopped = facts[3].stopped = True
    facts[0].group("1").issued, facts[0].group("1").hung = 42, ("all_reduce", 42)
    facts[0].group("1").hung_lately = True
    facts[0].group("9").issued = facts[0].group("9").finished = 20
    facts[1].group("1").issued = facts[1].group("1").finished = 41
    facts[1].group("6").p2p_failed = ("send", 3, None)
    facts[3].group("9").issued, facts[3].group("9").finished, facts[3].group("9").hung = 21, 20, ("all_reduce", 21)
    facts[3].group("9").hung_lately = True
    lines = [f.line() for f in findings(facts)]
    assert culprits("\n".join(lines)) == {3}, lines
