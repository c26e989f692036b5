"""The alert rules at the scrape intervals people run (15 s: the shipped PodMonitor's; 30 s:
kube-prometheus' default; 60 s), as ``commlens assets --scrape-interval`` writes them: promtool replays
each fault as its series look when scraped that often, and the culprit's alert fires within the hang
threshold (3 s here) and 3 scrape intervals of the fault, naming it alone; a healthy job fires none. The
rules as written (for scrapes of 2 s or less) go quiet there: the straggler case fails on them."""

import pathlib

import pytest
import yaml

from commlens.agent.verdicts.readers import scrape_interval_s
from commlens.agent.verdicts.rule_files import at_interval, parse_interval
from commlens.agent.verdicts.catalogue import VERDICT_ALERTS
from monitoring import Prometheus, promtool, wait_for
from ports import free_port

pytestmark = pytest.mark.torch_free  # no torch code: .ci/run runs it under one torch version

RULES = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "prometheus-rules.yaml"
FAULT_AT = 10
"""The fault strikes after this many scrapes."""
SCRAPES = 30
THRESHOLD_S = 3


def _series(name: str, labels: dict[str, str], values: list[float | None]) -> dict:
    text = " ".join("_" if value is None else repr(float(value)) for value in values)
    return {"series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in {"job": "train", **labels}.items()) + "}",
            "values": text}


def _counter(rate_before: float, rate_after: float, interval_s: int) -> list[float]:
    """A counter's samples, scrape by scrape, growing at ``rate_before`` per second, then from the fault on
    at ``rate_after``."""
    values, total = [], 0.0
    for scrape in range(SCRAPES):
        values.append(total)
        total += (rate_before if scrape < FAULT_AT else rate_after) * interval_s
    return values


def _from_fault(value: float) -> list[float | None]:
    return [None] * FAULT_AT + [value] * (SCRAPES - FAULT_AT)


def _straggler(interval_s: int, healthy: bool = False) -> list[dict]:
    """4 ranks of group 0, 10 collectives a second each: from the fault on rank 2 computes 60 ms longer
    before each, and the others wait for it in every one (``healthy``: nobody does, all wait 1 ms)."""
    series = []
    for rank in range(4):
        wait = 0.001 if rank == 2 or healthy else 0.061
        labels = {"instance": f"p{rank}", "pg": "0", "op": "all", "rank": str(rank)}
        series += [_series("commlens_collective_duration_seconds_sum", labels, _counter(0.01, 10 * wait, interval_s)),
                   _series("commlens_collective_duration_seconds_count", labels, _counter(10, 10, interval_s)),
                   _series("commlens_info", {"instance": f"p{rank}", "rank": str(rank)}, [1] * SCRAPES)]
    return series


def _late(interval_s: int) -> list[dict]:
    """Ranks 0, 1, 3 wait past the hang threshold in seq 40 of group 0; rank 2 issued only up to 39."""
    series = []
    for rank in range(4):
        labels = {"instance": f"p{rank}", "rank": str(rank)}
        series += [_series("commlens_collective_last_seq", {**labels, "pg": "0", "state": "enqueued"},
                           [39] * FAULT_AT + [39 if rank == 2 else 40] * (SCRAPES - FAULT_AT)),
                   _series("commlens_info", labels, [1] * SCRAPES)]
        if rank != 2:
            series.append(_series("commlens_collective_hung_seq", {**labels, "pg": "0", "op": "all_reduce"},
                                  [None] * (FAULT_AT + THRESHOLD_S // interval_s + 1) +
                                  [40] * (SCRAPES - FAULT_AT - THRESHOLD_S // interval_s - 1)))
    return series


def _nan(interval_s: int) -> list[dict]:
    """Rank 2's input held NaN at seq 40 of group 0; it reached ranks 0, 1, 3 in seq 41, which they
    had issued 40 before, and their scrapes come in first."""
    series = []
    for rank in range(4):
        labels = {"instance": f"p{rank}", "rank": str(rank)}
        seq, before = (40, 39) if rank == 2 else (41, 40)
        late = [None] if rank == 2 else []  # the origin's scrape comes a scrape after the others'
        for name, extra, value in (("commlens_nonfinite_first_seq", {"pg": "0", "op": "all_reduce", "kind": "nan"}, seq),
                                   ("commlens_nonfinite_entry_seq", {"pg": "0", "op": "all_reduce", "kind": "nan"}, seq),
                                   ("commlens_nonfinite_issued_before_seq", {"pg": "0"}, before)):
            series.append(_series(name, {**labels, **extra}, (late + _from_fault(value))[:SCRAPES]))
    return series


def _peer(interval_s: int) -> list[dict]:
    """Rank 3 waits in recv on rank 1 past the hang threshold (a pipeline stage late with its send)."""
    waited = [None] * FAULT_AT + [THRESHOLD_S + k * interval_s for k in range(SCRAPES - FAULT_AT)]
    return [_series("commlens_p2p_hung_seconds", {"instance": "p3", "rank": "3", "pg": "6", "op": "recv", "peer": "1"},
                    waited)] + [_series("commlens_info", {"instance": f"p{rank}", "rank": str(rank)}, [1] * SCRAPES)
                                for rank in range(4)]


def _killed(interval_s: int) -> list[dict]:
    """The pod sidecar saw rank 1's process end without a signal or an exception."""
    return [_series("commlens_abort_snapshots_total", {"instance": "pod", "rank": str(rank), "reason": "exit"},
                    [0] * FAULT_AT + [int(rank == 1)] * (SCRAPES - FAULT_AT)) for rank in range(4)]


FAULTS = {  # fault -> (its series, the alert, the rank it names, seconds from the fault it may take beyond 3 scrapes)
    "none": (lambda interval_s: _straggler(interval_s, healthy=True), None, None, 0),
    "straggler": (_straggler, "CommlensStraggler", "2", 0),
    "late": (_late, "CommlensRankLate", "2", THRESHOLD_S),
    "nan": (_nan, "CommlensNaNOrigin", "2", 0),
    "peer-late": (_peer, "CommlensPeerLate", "1", 0),
    "killed": (_killed, "CommlensRankKilled", "1", 0),
}


def _replay(tmp_path, rules: str, interval_s: int, fault: str) -> str:
    """promtool's verdict on ``fault``'s series scraped every ``interval_s`` under ``rules``: "" when, by
    the fault + its allowance + 3 scrape intervals, the fault's alert fires naming its rank (a healthy
    job's: none) and no other alert that names a culprit fires; else what promtool found instead."""
    _, alert, rank, allowance = FAULTS[fault]
    firing = f'count by (alertname, rank) (ALERTS{{alertstate="firing", alertname=~"{"|".join(CULPRIT_ALERTS)}"}})'
    (tmp_path / "rules.yaml").write_text(rules)
    found = replay(tmp_path, fault, interval_s, firing, FAULT_AT * interval_s + allowance + 3 * interval_s,
                   [{"labels": f'{{alertname="{alert}", rank="{rank}"}}', "value": 1}] if alert else [])
    return "" if found.returncode == 0 else found.stdout + found.stderr


def replay(folder, fault: str, interval_s: int, expr: str, at_s: int, expected: list[dict]):
    """promtool's run of ``fault``'s series scraped every ``interval_s`` under ``folder``'s ``rules.yaml``,
    asked whether ``expr`` at ``at_s`` seconds gives the ``expected`` samples."""
    document = {"rule_files": ["rules.yaml"], "evaluation_interval": f"{interval_s}s", "tests": [{
        "name": fault, "interval": f"{interval_s}s", "input_series": FAULTS[fault][0](interval_s),
        "promql_expr_test": [{"expr": expr, "eval_time": f"{at_s}s", "exp_samples": expected}]}]}
    (folder / "test.yaml").write_text(yaml.safe_dump(document, sort_keys=False))
    return promtool("test", "rules", "test.yaml", cwd=folder)


CULPRIT_ALERTS = VERDICT_ALERTS
"""The alerts that name a culprit (a rank, a node, the network): none but the fault's may fire."""


@pytest.mark.parametrize("interval", ["15s", "30s", "1m"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_at_the_scrape_intervals_people_run_each_fault_is_named_in_time_and_alone(tmp_path, interval, fault):
    seconds = parse_interval(interval)
    rules = at_interval(RULES.read_text(), seconds)
    assert _replay(tmp_path, rules, seconds, fault) == ""


def test_the_rules_as_written_go_quiet_at_a_30_s_scrape_where_the_rendered_ones_name_the_straggler(tmp_path):
    assert "CommlensStraggler" in _replay(tmp_path, RULES.read_text(), 30, "straggler")
    assert _replay(tmp_path, at_interval(RULES.read_text(), 30), 30, "straggler") == ""


def test_a_windows_offset_is_widened_with_its_range_and_an_evaluations_is_kept():
    """The offset that asks whether a series was there as a window began (a rank judged once its window
    is full) widens with the window; the one that reads the last evaluation (``offset 1s``) does not."""
    written = "rate(x[10s]) and on (job) x offset 10s\n`y offset 1s`\nz unless x offset 5m"
    assert at_interval(written, 30) == "rate(x[2m]) and on (job) x offset 2m\n`y offset 1s`\nz unless x offset 5m"
    assert at_interval(written, 2) == written


@pytest.mark.parametrize("text", ["90s", "0s", "15", "2h", "fast"])
def test_a_scrape_interval_out_of_range_is_refused_naming_what_is_accepted(text):
    with pytest.raises(ValueError, match=rf"'{text}' is not accepted: give a scrape interval of 1s to 60s"):
        parse_interval(text)


def test_diagnose_reads_prometheus_scrape_interval_to_size_its_windows(tmp_path):
    """``commlens diagnose --prometheus`` sizes its windows to 4 of Prometheus' scrapes (a 10 s rate at a
    30 s scrape holds one sample at most): it reads the interval from Prometheus' targets."""
    class Target:  # nothing listens there: the target is down, its interval known all the same
        targets = [f"127.0.0.1:{free_port()}"]

        def __exit__(self, *exc):
            pass

    with Prometheus(tmp_path, Target(), scrape_interval="30s") as prometheus:
        url = f"http://127.0.0.1:{prometheus.port}"
        assert wait_for(lambda: scrape_interval_s(url, "commlens") == 30, "the targets' scrape interval")
        assert scrape_interval_s(url, "another-job") == 1
