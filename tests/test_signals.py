"""SIGTERM, as Kubernetes and torchrun stop a rank: the snapshot is written even while the main thread
is blocked in a collective, the process ends as it would have, and a storm of them deadlocks nothing."""

import os
import pathlib
import pickle
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from commlens.agent.verdicts.readers import spans_in
from commlens.exporters import names
from ports import free_port, free_ports

TIMEOUT_S = 5
CHILDREN = pathlib.Path(__file__).resolve().parent / "children"


def _ranks(tmp_path, script, world_size, *args, metrics_port=0, hang_threshold_s=0.5):
    env = {**os.environ, "COMMLENS_METRICS_ADDR": "127.0.0.1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size),
           "COMMLENS_METRICS_PORT": str(metrics_port), "COMMLENS_TRACE_FILE": str(tmp_path / "spans-{rank}.jsonl"),
           "TORCHCOMM_FR_DUMP_TEMP_FILE": str(tmp_path / "rank_"), "COMMLENS_SNAPSHOT_TIMEOUT_S": str(TIMEOUT_S),
           "COMMLENS_HANG_THRESHOLD_S": str(hang_threshold_s)}
    jobs = []
    for rank in range(world_size):
        with open(tmp_path / f"stderr-{rank}", "w") as stderr:
            jobs.append(subprocess.Popen([sys.executable, str(script), *args],
                                         env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True))
    return jobs


def _until(condition, what, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _end(*jobs):
    for job in jobs:
        if job.poll() is None:
            job.kill()
        job.wait()
        job.stdin.close()
        job.stdout.close()


def _states(dump):
    return [(e["profiling_name"], e["state"]) for e in pickle.loads(dump.read_bytes())["entries"]]


def _stuck(rank0, dump):
    """Once rank 0 is inside the all_reduce rank 1 does not join (its hang snapshot says so), clear that snapshot."""
    assert rank0.stdout.readline() == "ready\n"
    _until(dump.exists, "no hang snapshot: rank 0 never got stuck in its all_reduce")
    dump.unlink()


def test_sigterm_inside_a_collective_writes_the_snapshot_and_ends_the_process_as_sigterm_does(tmp_path):
    rank0, rank1 = _ranks(tmp_path, CHILDREN / "signals_rank.py", 2, "collective")
    dump = tmp_path / "rank_0"
    try:
        _stuck(rank0, dump)
        rank0.send_signal(signal.SIGTERM)
        assert rank0.wait(TIMEOUT_S + 10) == -signal.SIGTERM
    finally:
        _end(rank0, rank1)
    assert _states(dump) == [("gloo:all_reduce", "completed"), ("gloo:all_reduce", "started")]
    assert (tmp_path / "spans-0.jsonl").read_text().count('"name":"all_reduce"') == 2  # done, and in flight


def test_a_job_stopped_while_a_rank_waits_in_a_collective_names_no_rank(tmp_path):
    """Kubernetes and torchrun stop every rank at once. A rank held in its SIGTERM snapshot keeps the
    ranks in a collective with it waiting past the hang threshold until the job ends: that wait is
    the stop's, and the verdict from the job's files names no rank late (it named the one that
    stopped first). The ranks are scraped once, so that each snapshot waits TIMEOUT_S for the next
    scrape: longer than the hang threshold."""
    port = free_ports(2)
    job = _ranks(tmp_path, CHILDREN / "stopped_rank.py", 2, metrics_port=port, hang_threshold_s=2)
    try:
        for rank in job:
            assert rank.stdout.readline() == "serving\n"
        for rank in range(2):
            urllib.request.urlopen(f"http://127.0.0.1:{port + rank}/metrics", timeout=10).close()
        for rank in job:
            rank.stdin.write("\n")
            rank.stdin.flush()
        assert job[0].stdout.readline() == "issued\n"
        for rank in job:
            rank.send_signal(signal.SIGTERM)
        assert [rank.wait(TIMEOUT_S + 10) for rank in job] == [-signal.SIGTERM] * 2
    finally:
        _end(*job)
    hangs = [attributes[names.SEQ] for _, attributes in spans_in(str(tmp_path)) if attributes.get(names.HANG)]
    assert hangs == [2], hangs  # rank 0 waited past the threshold in its second all_reduce as the job stopped
    report = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert "nothing wrong found" in report.stdout, report.stdout + report.stderr


@pytest.mark.parametrize("mode", ["python", "in-snapshot", "in-drain"])
def test_sigterm_in_python_writes_the_snapshot_and_ends_the_process_as_sigterm_does(tmp_path, mode):
    rank0, rank1 = _ranks(tmp_path, CHILDREN / "signals_rank.py", 2, mode)
    try:
        assert rank0.stdout.readline() == "ready\n"
        rank0.send_signal(signal.SIGTERM)
        assert rank0.wait(TIMEOUT_S + 10) == -signal.SIGTERM
    finally:
        _end(rank0, rank1)
    assert _states(tmp_path / "rank_0") == [("gloo:all_reduce", "completed")]
    if mode == "python":  # holding the drain's locks, the main thread may keep the span from the exporter
        assert (tmp_path / "spans-0.jsonl").read_text().count('"name":"all_reduce"') == 1


def test_a_rank_told_to_stop_while_it_holds_the_counters_lock_is_scraped_saying_so_before_it_ends(tmp_path):
    """SIGTERM comes while the main thread is in and out of the lock a scrape copies the counters
    under (as a drain of its own holds it). The rank keeps answering scrapes, one says it was told to
    stop, and then it ends as SIGTERM does: a rank whose last scrapes do not say so is named killed
    (``commlens:rank_vanished``). Held in the handler, the main thread kept the lock, the scrapes
    timed out, and the snapshot's wait for one ran out."""
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    rank0, rank1 = _ranks(tmp_path, CHILDREN / "signals_rank.py", 2, "busy", metrics_port=port)
    said = []

    def scrape() -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S + 10) as page:
            said.append(page.read().decode())

    try:
        assert rank0.stdout.readline() == "ready\n"
        scrape()  # scraped before, as by Prometheus: the snapshot waits for the next scrape
        rank0.send_signal(signal.SIGTERM)
        while rank0.poll() is None:  # ... which the test sends until the rank has ended
            try:
                scrape()
            except OSError:  # refused or cut off once it stopped serving
                pass
        assert rank0.wait() == -signal.SIGTERM
    finally:
        _end(rank0, rank1)
    told = [sample.value for page in said for family in text_string_to_metric_families(page)
            for sample in family.samples if sample.name == names.total(names.ABORT_SNAPSHOTS)
            and sample.labels.get("reason") == "signal"]
    assert 1.0 in told, f"{len(said)} scrapes answered, none with the signal's snapshot"


def test_the_users_own_handler_runs_once_the_collective_returns_after_the_snapshot(tmp_path):
    handled = tmp_path / "handled"
    rank0, rank1 = _ranks(tmp_path, CHILDREN / "signals_rank.py", 2, "user", str(handled))
    dump = tmp_path / "rank_0"
    try:
        _stuck(rank0, dump)
        rank0.send_signal(signal.SIGTERM)
        _until(dump.exists, "no snapshot while the main thread is blocked in the collective", TIMEOUT_S + 10)
        assert _states(dump) == [("gloo:all_reduce", "completed"), ("gloo:all_reduce", "started")]
        assert rank0.poll() is None and not handled.exists()  # the user's handler waits for the main thread
        rank1.stdin.write("join\n")
        rank1.stdin.flush()
        assert rank0.wait(60) == 3 and handled.read_text() == "handled", (tmp_path / "stderr-0").read_text()
        assert "returned" not in rank0.stdout.read()
    finally:
        _end(rank0, rank1)


def test_a_handler_of_the_users_that_passes_sigterm_on_to_commlens_ends_the_process_once_the_collective_returns(tmp_path):
    """A handler installed after commlens' that calls the one it replaced: the snapshot is written
    while the main thread is blocked in the collective; once it returns, the user's handler passes
    SIGTERM on and the process ends as SIGTERM's default does, before the script goes on."""
    rank0, rank1 = _ranks(tmp_path, CHILDREN / "signals_rank.py", 2, "chained")
    dump = tmp_path / "rank_0"
    try:
        _stuck(rank0, dump)
        rank0.send_signal(signal.SIGTERM)
        _until(dump.exists, "no snapshot while the main thread is blocked in the collective", TIMEOUT_S + 10)
        rank1.stdin.write("join\n")
        rank1.stdin.flush()
        assert rank0.wait(TIMEOUT_S + 10) == -signal.SIGTERM
        assert "returned" not in rank0.stdout.read()
    finally:
        _end(rank0, rank1)


def test_a_sigterm_storm_during_collectives_deadlocks_nothing(tmp_path):
    [job] = _ranks(tmp_path, CHILDREN / "signals_storm.py", 1)
    watchdog = threading.Timer(120, job.kill)  # a deadlock fails the test instead of hanging it
    watchdog.start()
    try:
        for _ in range(50):  # 4 SIGTERMs after each step the job reports: 200, spread over its loop
            assert job.stdout.readline().strip().isdigit(), "the job stopped looping"
            for _ in range(4):
                job.send_signal(signal.SIGTERM)
        job.stdin.close()
        out = job.stdout.read()
        assert job.wait() == 0, (tmp_path / "stderr-0").read_text()
    finally:
        watchdog.cancel()
        _end(job)
    _, handled, _, snapshots = out.splitlines()[-1].split()
    assert 1 <= int(handled) <= 200 and 1 <= int(snapshots) <= 200  # signals sent together may arrive as one


def test_a_forked_childs_sigterm_is_its_own(tmp_path):
    [job] = _ranks(tmp_path, CHILDREN / "signals_fork.py", 1)
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0 and out.split() == [str(int(signal.SIGTERM)), "0"], out
