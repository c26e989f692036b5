"""The shipped rules and dashboards on a real Prometheus at 1,000 and 10,000 ranks.

The series of one rank are taken from a real scrape: a 2-rank gloo job with four process groups
runs seven kinds of collectives in three sizes under commlens at its default metrics detail, and
rank 0's ``/metrics`` is the template. It is replicated for every simulated rank (eight ranks per
target, as a pod sidecar serves them) with the rank and group labels a job of that size has: the
world group, tensor-parallel groups of 8, data-parallel groups across them, and groups of 64;
counters grow at a steady rate. Three ranks are made faulty, each in another group: one never issues
the collective its tensor-parallel group hangs in (late), one is where NaN entered (its first
non-finite sequence number is the lowest), one waits least in its data-parallel group (a straggler).

Debian's Prometheus scrapes the targets every 10 s (the straggler rule's longest interval) and
evaluates ``deploy/prometheus-rules.yaml``.
Printed per size: series held, each rule group's evaluation time, the slowest dashboard panel query
(a 5-minute range, every job, group and rank), Prometheus' resident memory, and whether each alert
names the faulty rank, and only it.

    python bench/scale.py [--ranks 1000 10000]
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from prometheus_client.parser import text_string_to_metric_families

from commlens.agent.ports import free_port, free_ports

ROOT = pathlib.Path(__file__).resolve().parent.parent
RANKS_PER_TARGET, TP, EP = 8, 8, 64
GROWING = ("_total", "_sum", "_count", "_bucket")
WAIT_S = 0.02  # mean seconds in a collective; the straggler waits 1 ms
EXPECTED = {"CommlensRankLate": "late", "CommlensNaNOrigin": "nan", "CommlensStraggler": "straggler"}


def _template_rank(rank: int, base_port: int, out: dict) -> None:
    import warnings

    import commlens.agent

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renames of the *_tensor collectives
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", COMMLENS_METRICS_ADDR="127.0.0.1",
                      COMMLENS_METRICS_PORT=str(base_port), COMMLENS_TRACE_FILE=os.devnull)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    agent = commlens.agent.start()
    for group in [None] + [dist.new_group([0, 1]) for _ in range(3)]:
        for numel in (64, 16 << 10, 1 << 20):
            t = torch.ones(numel)
            dist.all_reduce(t, group=group)
            dist.broadcast(t, 0, group=group)
            dist.all_gather_into_tensor(torch.empty(2 * numel), t, group=group)
            dist.reduce_scatter_tensor(torch.empty(numel // 2), t, group=group)
            dist.all_to_all_single(torch.empty_like(t), t, group=group)
        dist.barrier(group=group)
    agent.sidecar.drain()
    if rank == 0:
        out["text"] = urllib.request.urlopen(f"http://127.0.0.1:{base_port}/metrics", timeout=10).read().decode()
    dist.barrier()
    commlens.agent.stop()
    dist.destroy_process_group()


def template() -> str:
    """Rank 0's scrape of a real four-group job under commlens' defaults."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_template_rank, args=(free_ports(2), out), nprocs=2, start_method="spawn")
        return out["text"]


class Job:
    """The exposition of ``ranks`` simulated ranks, one text per target, at any moment."""

    def __init__(self, text: str, ranks: int):
        self.ranks, self.started = ranks, time.monotonic()
        self.faulty = {"late": ranks // 2 + 3, "nan": ranks // 3 + 1, "straggler": ranks - 5}
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples
                   if not s.name.endswith("_created")]
        self.targets = [self._target(samples, first) for first in range(0, ranks, RANKS_PER_TARGET)]

    def _groups(self, rank: int) -> dict[str, str]:
        return {"0": "0", "1": f"tp{rank // TP}", "2": f"dp{rank % TP}", "3": f"ep{rank // EP}"}

    def _target(self, samples: list, first: int) -> list[tuple[str, float, float]]:
        """(series, value at start, growth per second) of the ranks ``first ..`` of one target."""
        lines = []
        late, late_tp = self.faulty["late"], f"tp{self.faulty['late'] // TP}"
        for rank in range(first, min(first + RANKS_PER_TARGET, self.ranks)):
            groups = self._groups(rank)
            straggling = rank == self.faulty["straggler"]
            counts = {}  # the growth of each duration histogram's count, by its labels
            for s in samples:
                labels = {**s.labels, "rank": str(rank)}
                if "pg" in labels:
                    labels["pg"] = groups.get(labels["pg"], labels["pg"])
                value, growth = s.value, 0.0
                if s.name.endswith(GROWING):
                    growth = s.value / 10  # as if the template's counts took 10 s
                if s.name == "commlens_collective_duration_seconds_count":
                    counts[tuple(sorted(labels.items()))] = growth
                if s.name == "commlens_collective_last_seq" and labels["pg"] == late_tp:
                    value, growth = (499 if rank == late or labels["state"] == "completed" else 500), 0.0
                lines.append((s.name, labels, value, growth))
            for i in range(len(lines) - len(samples), len(lines)):  # mean waits: the straggler's in its dp group
                name, labels, value, _ = lines[i]
                if name == "commlens_collective_duration_seconds_sum":
                    wait = 0.001 if straggling and labels["pg"] == groups["2"] else WAIT_S
                    lines[i] = (name, labels, value, counts[tuple(sorted(labels.items()))] * wait)
            if groups["1"] == late_tp and rank != late:
                lines.append(("commlens_collective_hung_seq", {"pg": late_tp, "op": "all_reduce", "rank": str(rank)},
                              500, 0.0))
            nan_seq = 1000 if rank == self.faulty["nan"] else 1001
            lines.append(("commlens_nonfinite_first_seq", {"pg": "0", "op": "all_reduce", "kind": "nan",
                                                           "rank": str(rank)}, nan_seq, 0.0))
        return [(f"{name}{{{','.join(f'{k}={json.dumps(v)}' for k, v in labels.items())}}}", value, growth)
                for name, labels, value, growth in lines]

    def text(self, target: int) -> bytes:
        t = time.monotonic() - self.started
        return ("".join(f"{series} {value + growth * t}\n" for series, value, growth
                                     in self.targets[target])).encode()


def serve(job: Job) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = job.text(int(self.path.rsplit("/", 1)[1]))
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except BrokenPipeError:  # Prometheus gave up on this scrape: its `up` says so
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    return json.loads(urllib.request.urlopen(url, timeout=300).read())["data"]


def _panels() -> list[tuple[str, str]]:
    panels = []
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", ()):
                expr = re.sub(r'\$(job|pg|rank)\b', ".*", target["expr"]).replace("$__rate_interval", "1m")
                panels.append((f"{path.stem}: {panel['title']}", expr))
    return panels


def measure(text: str, ranks: int, out: pathlib.Path) -> dict:
    job = Job(text, ranks)
    server = serve(job)
    port = free_ports(1)
    targets = [{"targets": [f"127.0.0.1:{server.server_port}"],
                "labels": {"__metrics_path__": f"/metrics/{i}", "instance": f"pod-{i}"}} for i in range(len(job.targets))]
    config = {"global": {"scrape_interval": "10s", "evaluation_interval": "10s", "scrape_timeout": "10s"},
              "rule_files": [str(ROOT / "deploy" / "prometheus-rules.yaml")],
              "scrape_configs": [{"job_name": "train", "static_configs": targets}]}
    (out / "prometheus.yml").write_text(json.dumps(config))
    prometheus = subprocess.Popen(["prometheus", f"--config.file={out / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={out / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=open(out / "prometheus.log", "w"))
    try:
        named, deadline = {}, time.monotonic() + 240
        while time.monotonic() < deadline:
            time.sleep(10)
            try:
                alerts = _api(port, "alerts")["alerts"]
            except OSError:
                continue
            named = {}
            for alert in alerts:
                if alert["state"] == "firing":
                    named.setdefault(alert["labels"]["alertname"], set()).add(int(alert["labels"].get("rank", -1)))
            if all(name in named for name in EXPECTED) and time.monotonic() - job.started > 90:
                break
        series = _api(port, "status/tsdb")["headStats"]["numSeries"]
        up = _api(port, "query", query="avg_over_time(up[1m])")["result"]
        scraped = sum(float(r["value"][1]) for r in up) / max(1, len(up))
        slowest_scrape = float(_api(port, "query", query="max(scrape_duration_seconds)")["result"][0]["value"][1])
        rules = {group["name"]: group["evaluationTime"] for group in _api(port, "rules")["groups"]}
        end = time.time()
        queries = []
        for name, expr in _panels():
            started = time.perf_counter()
            _api(port, "query_range", query=expr, start=end - 300, end=end, step=15)
            queries.append((time.perf_counter() - started, name))
        with open(f"/proc/{prometheus.pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 2**20
    finally:
        prometheus.terminate()
        prometheus.wait()
        server.shutdown()
    verdicts = {alert: (named.get(alert, set()) == {job.faulty[fault]}) for alert, fault in EXPECTED.items()}
    return {"series": series, "scraped": scraped, "slowest_scrape": slowest_scrape, "rules": rules, "slowest": max(queries), "rss_gib": rss, "verdicts": verdicts,
            "named": {alert: sorted(named.get(alert, ())) for alert in EXPECTED}, "faulty": job.faulty}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1000, 10000])
    args = parser.parse_args()
    if shutil.which("prometheus") is None:
        print("bench/scale.py needs Prometheus on PATH (Debian: apt-get install prometheus)", file=sys.stderr)
        return 2
    text = template()
    per_rank = sum(1 for f in text_string_to_metric_families(text) for s in f.samples
                   if not s.name.endswith("_created"))
    print(f"one rank of a four-group job exposes {per_rank} series (commlens defaults)")
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory(prefix="commlens-scale-") as folder:
            result = measure(text, ranks, pathlib.Path(folder))
        rules = ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in result["rules"].items())
        seconds, panel = result["slowest"]
        print(f"{ranks:,} ranks: {result['series']:,} series; scrapes that succeeded over the last minute "
              f"{result['scraped']:.0%}, slowest {result['slowest_scrape'] * 1e3:.0f} ms; rule groups: {rules}; slowest "
              f"panel query {seconds * 1e3:.0f} ms ({panel}); Prometheus {result['rss_gib']:.2f} GiB resident")
        for alert, right in result["verdicts"].items():
            fault = EXPECTED[alert]
            print(f"  {alert}: names {result['named'][alert]} — the {fault} rank is {result['faulty'][fault]}: "
                  f"{'right' if right else 'WRONG'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
