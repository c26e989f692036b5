"""The shipped rules and dashboards on a real Prometheus at 1,000 and 10,000 ranks.

The series of one rank are taken from a real scrape: a 2-rank gloo job with four process groups
runs seven kinds of collectives in three sizes under commlens at its default metrics detail, and
rank 0's ``/metrics`` is the template. It is replicated for every simulated rank (eight ranks per
target, a node, as its pod sidecar serves them; commlens_info's ``node`` is ``node-<target>``) with the
rank and group labels a job of that size has: the world group, tensor-parallel groups of 8,
data-parallel groups across them, and groups of 64; counters grow at a steady rate. Of the ranks, all
but 128 are one job, ``train``, with two ranks made faulty, each in another group: one never issues the
collective its tensor-parallel group hangs in (late), one is where NaN entered (the first non-finite
input, in a world collective that reached the others through its output). 64 are a second job,
``train-slow``, one of whose ranks waits least in every group it is in (a straggler: it arrives last to
each collective, and spends less time in collectives than any member of its groups): a job that hangs
names no straggler. The last 64 (8 nodes) are a third, ``train-node``, as its own job because an
unreachable node silences the rank alerts of its job: one node stops answering scrapes after its second,
and the ranks of the other nodes then wait in a world-group collective its ranks have not issued.

Debian's Prometheus scrapes the targets every 10 s and evaluates ``deploy/prometheus-rules.yaml`` as
``commlens assets --scrape-interval 10s`` writes it (its windows 4 scrapes long).
Printed per size: series held (in all, and of one node), each rule group's evaluation time and the
node rules' own, the slowest dashboard panel query (a 5-minute range, every job, group and rank),
Prometheus' resident memory, whether each alert names the faulty rank (or node), and only it, and
the other alerts firing.

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

from commlens.agent.cli.ports import free_port, free_ports
from commlens.agent.verdicts.rule_files import at_interval

ROOT = pathlib.Path(__file__).resolve().parent.parent
INTERVAL_S = 10
"""How often the targets are scraped and the rules evaluated."""
RANKS_PER_TARGET, TP, EP = 8, 8, 64
SMALL_JOB_RANKS = 64  # each of the two small jobs (8 nodes): the straggler's, the unreachable node's
GROWING = ("_total", "_sum", "_count", "_bucket")
WAIT_S = 0.02  # mean seconds in a collective; the straggler waits 1 ms
EXPECTED = {"CommlensRankLate": "late", "CommlensNaNOrigin": "nan", "CommlensStraggler": "straggler",
            "CommlensNodeUnreachable": "node"}


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


def _exposed(lines: list) -> list[tuple[str, float, float]]:
    return [(f"{name}{{{','.join(f'{k}={json.dumps(v)}' for k, v in labels.items())}}}", value, growth)
            for name, labels, value, growth in lines]


class Job:
    """The exposition of job ``name``'s ``ranks`` simulated ranks, one text per target (node ``first_node``
    and on), at any moment. ``faults``: the late, NaN origin and straggler ranks, or ``node``, the index of
    the node that becomes unreachable once scraped twice; the ranks of the other nodes then wait in
    collective 500 of the world group, which its ranks have not issued."""

    def __init__(self, name: str, text: str, ranks: int, first_node: int, faults: dict[str, int]):
        self.name, self.ranks, self.first_node, self.started = name, ranks, first_node, time.monotonic()
        self.faults, self.down = faults, faults.get("node")
        self.faulty = {fault: f"{name}/node-{first_node + rank}" if fault == "node" else f"{name}/{rank}"
                       for fault, rank in faults.items()}
        if "late" in faults:  # the group that hangs, and its ranks that have not issued the collective
            self.hung_pg, self.behind = f"tp{faults['late'] // TP}", {faults["late"]}
        elif "node" in faults:
            self.hung_pg, self.behind = "0", set(range(faults["node"] * RANKS_PER_TARGET,
                                                       (faults["node"] + 1) * RANKS_PER_TARGET))
        else:  # nothing hangs
            self.hung_pg, self.behind = None, set()
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples
                   if not s.name.endswith("_created")]
        self.targets, self.hung = zip(*(self._target(samples, first) for first in range(0, ranks, RANKS_PER_TARGET)))
        self.scrapes = [0] * len(self.targets)

    def _groups(self, rank: int) -> dict[str, str]:
        return {"0": "0", "1": f"tp{rank // TP}", "2": f"dp{rank % TP}", "3": f"ep{rank // EP}"}

    def _target(self, samples: list, first: int) -> tuple[list, list]:
        """(series, value at start, growth per second) of the ranks ``first ..`` of one target: always,
        and while their group hangs."""
        lines, hung = [], []
        node = f"node-{self.first_node + first // RANKS_PER_TARGET}"
        for rank in range(first, min(first + RANKS_PER_TARGET, self.ranks)):
            groups = self._groups(rank)
            straggling = rank == self.faults.get("straggler")
            counts = {}  # the growth of each duration histogram's count, by its labels
            for s in samples:
                labels = {**s.labels, "rank": str(rank)}
                if "pg" in labels:
                    labels["pg"] = groups.get(labels["pg"], labels["pg"])
                if s.name == "commlens_info":
                    labels["node"] = node
                value, growth = s.value, 0.0
                if s.name.endswith(GROWING):
                    growth = s.value / 10  # as if the template's counts took 10 s
                if s.name == "commlens_collective_duration_seconds_count":
                    counts[tuple(sorted(labels.items()))] = growth
                if s.name == "commlens_collective_last_seq" and labels["pg"] == self.hung_pg:
                    value, growth = (499 if rank in self.behind or labels["state"] == "completed" else 500), 0.0
                lines.append((s.name, labels, value, growth))
            for i in range(len(lines) - len(samples), len(lines)):  # mean waits: the straggler's the least
                name, labels, value, _ = lines[i]
                if name == "commlens_collective_duration_seconds_sum":
                    wait = 0.001 if straggling else WAIT_S
                    lines[i] = (name, labels, value, counts[tuple(sorted(labels.items()))] * wait)
            if self.hung_pg in groups.values() and rank not in self.behind:
                hung.append(("commlens_collective_hung_seq", {"pg": self.hung_pg, "op": "all_reduce",
                                                              "rank": str(rank)}, 500, 0.0))
            if "nan" in self.faults:  # NaN entered on one rank in world collective 1000, reached the rest in it
                seq = 1000 if rank == self.faults["nan"] else 1001
                nan = {"pg": "0", "op": "all_reduce", "kind": "nan", "rank": str(rank)}
                lines += [("commlens_nonfinite_first_seq", nan, seq, 0.0), ("commlens_nonfinite_entry_seq", nan, seq, 0.0),
                          ("commlens_nonfinite_issued_before_seq", {"pg": "0", "rank": str(rank)}, seq - 1, 0.0)]
        return _exposed(lines), _exposed(hung)

    def text(self, target: int) -> bytes | None:
        """None (unreachable) for the node that goes down, from its third scrape on."""
        self.scrapes[target] += 1
        down = self.down is not None and self.scrapes[self.down] > 2
        if down and target == self.down:
            return None
        t = time.monotonic() - self.started
        hanging = self.down is None or down
        return ("".join(f"{series} {value + growth * t}\n" for series, value, growth
                        in self.targets[target] + (self.hung[target] if hanging else []))).encode()


def faulty_jobs(text: str, ranks: int) -> list[Job]:
    """``ranks`` simulated ranks in three jobs: ``train`` (all but 128: a late rank, a NaN origin),
    ``train-slow`` (64: a straggler; a job that hangs names none) and ``train-node`` (64, 8 nodes: one
    becomes unreachable; its job's rank alerts are silenced while it is)."""
    n = ranks - 2 * SMALL_JOB_RANKS
    train = Job("train", text, n, 0, {"late": n // 2 + 3, "nan": n // 3 + 1})
    slow = Job("train-slow", text, SMALL_JOB_RANKS, len(train.targets), {"straggler": SMALL_JOB_RANKS - 5})
    node = Job("train-node", text, SMALL_JOB_RANKS, len(train.targets) + len(slow.targets), {"node": 3})
    return [train, slow, node]


def serve(jobs: list[Job]) -> http.server.ThreadingHTTPServer:
    """Serves target ``t`` of job ``name`` at ``/metrics/<name>/<t>``."""
    by_name = {job.name: job for job in jobs}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            _, _, name, target = self.path.split("/")
            body = by_name[name].text(int(target))
            if body is None:
                self.send_error(503)
                return
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


def rules_at(interval_s: int, out: pathlib.Path) -> pathlib.Path:
    """``deploy/prometheus-rules.yaml`` as ``commlens assets --scrape-interval`` writes it for ``interval_s``,
    in ``out``: what a user scraping that often deploys."""
    path = out / "prometheus-rules.yaml"
    path.write_text(at_interval((ROOT / "deploy" / "prometheus-rules.yaml").read_text(), interval_s))
    return path


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
    jobs = faulty_jobs(text, ranks)
    train = jobs[0]
    server = serve(jobs)
    port = free_ports(1)
    scrape_configs = [{"job_name": job.name, "static_configs": [
        {"targets": [f"127.0.0.1:{server.server_port}"],
         "labels": {"__metrics_path__": f"/metrics/{job.name}/{t}", "instance": f"pod-{job.first_node + t}"}}
        for t in range(len(job.targets))]} for job in jobs]
    every = f"{INTERVAL_S}s"
    config = {"global": {"scrape_interval": every, "evaluation_interval": every, "scrape_timeout": every},
              "rule_files": [str(rules_at(INTERVAL_S, out))], "scrape_configs": scrape_configs}
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
            named = firing(alerts)
            if all(name in named for name in EXPECTED) and time.monotonic() - train.started > 90:
                break
        series = _api(port, "status/tsdb")["headStats"]["numSeries"]
        node_series = int(_api(port, "query", query='count({instance="pod-0"})')["result"][0]["value"][1])
        down = f"pod-{jobs[-1].first_node + jobs[-1].down}"
        up = _api(port, "query", query=f'avg_over_time(up{{instance!="{down}"}}[1m])')["result"]
        scraped = sum(float(r["value"][1]) for r in up) / max(1, len(up))
        slowest_scrape = float(_api(port, "query", query="max(scrape_duration_seconds)")["result"][0]["value"][1])
        groups = _api(port, "rules")["groups"]
        rules = {group["name"]: group["evaluationTime"] for group in groups}
        node_rules = {rule["name"]: rule["evaluationTime"] for group in groups for rule in group["rules"]
                      if "node" in rule["name"].lower()}
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
    return {"series": series, "node_series": node_series, "scraped": scraped, "slowest_scrape": slowest_scrape,
            "rules": rules, "node_rules": node_rules, "slowest": max(queries), "rss_gib": rss, **judged(jobs, named)}


def firing(alerts: list[dict]) -> dict[str, set[str]]:
    """Of alerts as an alerting API lists them: each firing alert's name, and the "job/rank" or
    "job/node" each one names."""
    named: dict[str, set[str]] = {}
    for alert in alerts:
        if alert["state"] == "firing":
            labels = alert["labels"]
            named.setdefault(labels["alertname"], set()).add(f"{labels.get('job')}/{labels.get('node', labels.get('rank'))}")
    return named


def judged(jobs: list[Job], named: dict[str, set[str]]) -> dict:
    """What ``print_verdicts`` reads: the alerts ``named`` (``firing``'s), each fault's culprit, and
    whether each fault's alert names its culprit and only it."""
    faulty = {fault: subject for job in jobs for fault, subject in job.faulty.items()}
    return {"named": {alert: sorted(subjects) for alert, subjects in named.items()}, "faulty": faulty,
            "verdicts": {alert: named.get(alert, set()) == {faulty[fault]} for alert, fault in EXPECTED.items()}}


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
        rules, node_rules = (", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in result[key].items())
                             for key in ("rules", "node_rules"))
        seconds, panel = result["slowest"]
        print(f"{ranks:,} ranks: {result['series']:,} series, {result['node_series']:,} of one node; scrapes "
              f"that succeeded over the last minute {result['scraped']:.0%}, slowest "
              f"{result['slowest_scrape'] * 1e3:.0f} ms; rule groups: {rules} (node rules: {node_rules}); slowest "
              f"panel query {seconds * 1e3:.0f} ms ({panel}); Prometheus {result['rss_gib']:.2f} GiB resident")
        print_verdicts(result)
    return 0


def print_verdicts(result: dict) -> None:
    """Each fault's alert, the ranks (or node) it names and whether that is its culprit alone; then the
    other alerts firing."""
    for alert, right in result["verdicts"].items():
        fault = EXPECTED[alert]
        print(f"  {alert}: names {result['named'].get(alert, [])} — the {fault} fault is "
              f"{result['faulty'][fault]}: {'right' if right else 'WRONG'}")
    for alert in sorted(set(result["named"]) - set(EXPECTED)):
        print(f"  also firing: {alert} on {', '.join(result['named'][alert])}")


if __name__ == "__main__":
    sys.exit(main())
