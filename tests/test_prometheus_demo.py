"""The demo, scraped by a real Prometheus (Debian's package); its summary names injected faults."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from commlens.agent.demo import Fault, free_ports, run

WORLD, STEPS = 3, 6
CONTRACT = ["commlens_collective_duration_seconds_bucket", "commlens_collective_duration_seconds_sum",
            "commlens_collective_duration_seconds_count", "commlens_collectives_total",
            "commlens_collective_bytes_total", "commlens_collective_bus_bytes_total", "commlens_collective_last_seq",
            "commlens_collective_inflight", "commlens_collective_inflight_oldest_seconds", "commlens_hangs_total",
            "commlens_nan_events_total", "commlens_abort_snapshots_total", "commlens_ring_records_dropped_total",
            "commlens_spans_exported_total", "commlens_info"]


def _query(port, expression):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)["data"]["result"]


def _by_rank(port, expression):
    return {int(r["metric"]["rank"]): float(r["value"][1]) for r in _query(port, expression)}


def _ready(condition):
    try:
        return condition()
    except OSError:  # Prometheus is still starting
        return False


def _wait_for(condition, what, timeout_s=90):
    deadline = time.monotonic() + timeout_s
    while not _ready(condition):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


@pytest.fixture
def demo_serving(tmp_path):
    base = free_ports(WORLD)
    env = {**os.environ, "COMMLENS_METRICS_PORT": str(base)}
    demo = subprocess.Popen([sys.executable, "-m", "commlens.agent.cli", "demo", "--world-size", str(WORLD),
                             "--steps", str(STEPS), "--out", str(tmp_path / "demo"), "--keep-serving"],
                            env=env, stdout=subprocess.PIPE, stderr=open(tmp_path / "demo.log", "w"), text=True,
                            start_new_session=True)
    try:
        serving = 0
        while serving < WORLD:
            line = demo.stdout.readline()
            assert line, "the demo ended before serving its metrics"
            serving += line.count("serving metrics until SIGTERM")
        yield base, tmp_path / "demo"
    finally:
        os.killpg(demo.pid, signal.SIGTERM)
        demo.wait(60)


def test_prometheus_scrapes_every_contract_metric_for_every_rank_with_the_right_values(demo_serving, tmp_path):
    base, out = demo_serving
    prometheus = _installed("prometheus")
    web = free_ports(1)
    targets = ", ".join(f"'127.0.0.1:{base + r}'" for r in range(WORLD))
    (tmp_path / "prometheus.yml").write_text(
        f"global: {{scrape_interval: 1s}}\nscrape_configs:\n  - job_name: commlens\n"
        f"    static_configs: [{{targets: [{targets}]}}]\n")
    server = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for name in CONTRACT:
            _wait_for(lambda: set(_by_rank(web, f"count by (rank) ({name})")) == set(range(WORLD)),
                      f"{name} for every rank")
        results = [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(WORLD)]
        # What every rank did: per step a learning-rate broadcast, DDP's bucket all_reduce, the loss
        # all_reduce; then one barrier.
        expected_count = 3 * STEPS + 1
        assert _by_rank(web, "sum by (rank) (commlens_collectives_total)") == {r: expected_count for r in range(WORLD)}
        assert _by_rank(web, "sum by (rank) (commlens_collective_duration_seconds_count)") == \
            {r: expected_count for r in range(WORLD)}
        all_reduce_bytes = {r: STEPS * (results[r]["param_bytes"] + 4) for r in range(WORLD)}
        assert _by_rank(web, 'commlens_collective_bytes_total{op="all_reduce"}') == all_reduce_bytes
        assert _by_rank(web, 'commlens_collective_bus_bytes_total{op="all_reduce"}') == \
            {r: b * 2 * (WORLD - 1) / WORLD for r, b in all_reduce_bytes.items()}
        assert _by_rank(web, 'commlens_collective_bytes_total{op="broadcast"}') == {r: 4 * STEPS for r in range(WORLD)}
        last = _by_rank(web, 'commlens_collective_last_seq{state="completed"}')
        assert last == {r: results[r]["step_seqs"][-1] for r in range(WORLD)}  # c10d's own count at the end
        assert _by_rank(web, "sum by (rank) (commlens_hangs_total) + sum by (rank) (commlens_nan_events_total)") == \
            {r: 0 for r in range(WORLD)}
        assert _by_rank(web, "commlens_collective_inflight") == {r: 0 for r in range(WORLD)}
        live = urllib.request.urlopen(f"http://127.0.0.1:{base}/metrics", timeout=5).read()
        check = subprocess.run([_installed("promtool"), "check", "metrics"], input=live, capture_output=True)
        assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check
    finally:
        server.terminate()
        server.wait(30)


def _installed(name):
    path = shutil.which(name)
    assert path, f"{name} is not installed: CI installs Debian's prometheus package (.ci/run)"
    return path


@pytest.mark.parametrize("fault, expected", [
    ("nan:rank=1:step=3", "NaN: first on rank 1 at step 3"),
    ("hang:rank=2:step=2", "late: rank 2"),
    ("slow:rank=0:ms=150", "slowest rank: 0"),
])
def test_the_demo_summary_names_the_injected_rank_and_step(tmp_path, fault, expected):
    outcome = run(WORLD, 5, str(tmp_path), Fault.parse(fault))
    assert expected in outcome.summary, outcome.summary
    if fault.startswith("hang"):
        assert "in all_reduce" in outcome.summary or "in broadcast" in outcome.summary
        assert "step 2" in outcome.summary
    for rank in range(WORLD):  # the embedded default sink: OTLP JSON, one export request per line
        lines = (tmp_path / f"traces-rank{rank}.jsonl").read_text().splitlines()
        spans = [s for line in lines for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"]
                 for s in ss["spans"]]
        assert spans and all(len(s["traceId"]) == 32 and len(s["spanId"]) == 16 for s in spans)
