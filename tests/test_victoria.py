"""The shipped rules past one Prometheus, on ``bench/scale.py``'s simulated jobs at a small size: two
vmagents sharing the targets, VictoriaMetrics and vmalert (``bench/victoria.py``), and three Prometheus
servers sharded by job (``bench/shards.py``). Every alert names its culprit and only it, and ``commlens
diagnose --prometheus`` reads the verdict back from VictoriaMetrics' Prometheus API and from the
server that holds the job. About 80 s and 35 s, most of it waiting: the stack at a 2 s interval until
the straggler's 20 s windows fill and every alert's `for` has passed (a shorter interval would not be
the scrape vmagents run); marked long and bench (CI runs them once), on one worker, which makes the
template job (two real ranks) once."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))

import shards  # noqa: E402
import victoria  # noqa: E402
from scale import EXPECTED, template  # noqa: E402

pytestmark = [pytest.mark.bench, pytest.mark.long, pytest.mark.xdist_group("past-one-prometheus")]


@pytest.fixture(scope="module")
def rank_text() -> str:
    return template()


def test_vmalert_over_sharded_vmagents_names_each_culprit_and_diagnose_reads_it_back(tmp_path, rank_text):
    result = victoria.measure(rank_text, ranks=264, agents=2, out=tmp_path, interval_s=2)
    assert all(result["verdicts"].values()), result["named"]
    assert set(result["named"]) == set(EXPECTED), result["named"]  # no other alert fired
    late = result["faulty"]["late"].split("/")[1]
    assert f"rank {late}" in result["diagnose"], result["diagnose"]
    assert all(seconds > 0 for seconds in result["evaluation"].values()), result["evaluation"]


def test_prometheus_servers_sharded_by_job_each_name_their_jobs_culprits_and_diagnose_reads_them(tmp_path, rank_text):
    result = shards.measure(rank_text, ranks=264, shards=3, out=tmp_path, interval_s=2)
    assert all(result["verdicts"].values()), result["named"]
    assert set(result["named"]) == set(EXPECTED), result["named"]  # no other alert fired
    held = {job: server for server in result["servers"] for job in server["jobs"]}
    assert sorted(held) == ["train", "train-node", "train-slow"] and len({id(s) for s in held.values()}) == 2, held
    for fault, job in (("late", "train"), ("straggler", "train-slow")):  # each read back where its job is
        rank = result["faulty"][fault].split("/")[1]
        assert f"{job}: " in held[job]["diagnose"] and f"rank {rank} " in held[job]["diagnose"], held[job]["diagnose"]
    empty = [server for server in result["servers"] if not server["jobs"]]
    assert len(empty) == 1 and "no commlens metrics" in empty[0]["diagnose"], empty
