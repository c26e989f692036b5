"""The shipped rules on Prometheus' own sharding: each job's targets on one of ``--shards`` Prometheus
servers, chosen by hashmod relabelling of the ``job`` label, on the simulated jobs of ``bench/scale.py``.

Every rule reads and aggregates one job's series (by ``job``), so a job whole on one server has every
rule evaluated whole there: each server runs ``deploy/prometheus-rules.yaml`` as ``commlens assets --scrape-interval
10s`` writes it on the jobs it holds, and all notify one Alertmanager. ``commlens diagnose --prometheus`` reads the server that holds
the job. hashmod balances jobs, not ranks: of the three jobs here, 2 servers would hold all three on one,
3 servers hold two on one, one on another and none on the third. Printed per size: which jobs each server holds, its series and rule groups' evaluation time,
whether each alert names its culprit and only it (as on one Prometheus), the other alerts firing, and
what ``diagnose`` says on each server. The other road past one Prometheus: ``bench/victoria.py``.

    python bench/shards.py [--ranks 1000 10000] [--shards 3]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from scale import EXPECTED, faulty_jobs, firing, judged, print_verdicts, rules_at, serve, template  # noqa: E402
from victoria import QUERY_TIMEOUT, end, get_json, wait_ready  # noqa: E402

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from commlens.agent.cli.ports import free_ports  # noqa: E402

INTERVAL_S = 10


def evaluations(port: int) -> int:
    """How many times the Prometheus server on ``port`` has evaluated each of its rule groups, the least:
    its own metrics count the iterations scheduled and, of them, those skipped because an evaluation
    outlasted the interval."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    done: collections.Counter = collections.Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "prometheus_rule_group_iterations_total":
                done[sample.labels["rule_group"]] += sample.value
            elif sample.name == "prometheus_rule_group_iterations_missed_total":
                done[sample.labels["rule_group"]] -= sample.value
    return int(min(done.values(), default=0))


def measure(text: str, ranks: int, shards: int, out: pathlib.Path, interval_s: int = INTERVAL_S) -> dict:
    """One size: ``shards`` Prometheus servers, each keeping the jobs whose label hashes to it, scraping and
    evaluating every ``interval_s`` until every expected alert fires (after 9 evaluations of the rules at
    least: the rest may fire too) or the rules have been evaluated 30 times. Evaluations, not intervals: on
    a loaded host one evaluation of the rules over 264 ranks took 38 s where the interval is 2 s, and
    Prometheus skips the evaluations it missed."""
    jobs = faulty_jobs(text, ranks)
    train = jobs[0]
    server = serve(jobs)
    base = free_ports(1 + shards)
    alertmanager, *ports = range(base, base + 1 + shards)
    (out / "alertmanager.yml").write_text(json.dumps({"route": {"receiver": "none"}, "receivers": [{"name": "none"}]}))
    logs = open(out / "components.log", "w")
    processes = [subprocess.Popen(["prometheus-alertmanager", f"--config.file={out / 'alertmanager.yml'}",
                                   f"--storage.path={out / 'am'}", f"--web.listen-address=127.0.0.1:{alertmanager}",
                                   "--cluster.listen-address="], stdout=logs, stderr=subprocess.STDOUT)]
    try:
        for shard, port in enumerate(ports):
            keep = [{"source_labels": ["job"], "modulus": shards, "target_label": "__tmp_shard", "action": "hashmod"},
                    {"source_labels": ["__tmp_shard"], "regex": str(shard), "action": "keep"}]
            config = {"global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s",
                                 "scrape_timeout": f"{interval_s}s"},
                      "rule_files": [str(rules_at(interval_s, out))],
                      "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{alertmanager}"]}]}]},
                      "scrape_configs": [{"job_name": job.name, "relabel_configs": keep, "static_configs": [
                          {"targets": [f"127.0.0.1:{server.server_port}"],
                           "labels": {"__metrics_path__": f"/metrics/{job.name}/{t}", "instance": f"pod-{job.first_node + t}"}}
                          for t in range(len(job.targets))]} for job in jobs]}
            (out / f"prometheus-{shard}.yml").write_text(json.dumps(config))
            processes.append(subprocess.Popen(
                ["prometheus", f"--config.file={out / f'prometheus-{shard}.yml'}", f"--storage.tsdb.path={out / f'data-{shard}'}",
                 f"--web.listen-address=127.0.0.1:{port}"], stdout=logs, stderr=subprocess.STDOUT))
        for port in ports:
            wait_ready(port, "/-/ready")
        named, evaluated = {}, 0
        while evaluated < 30:
            time.sleep(interval_s)
            named = firing([alert for port in ports for alert in get_json(port, "/api/v1/alerts")["data"]["alerts"]])
            evaluated = min(evaluations(port) for port in ports)
            if all(name in named for name in EXPECTED) and evaluated >= 9:
                break
        fired_after_s = time.monotonic() - train.started
        held = []
        for port in ports:
            targets = get_json(port, "/api/v1/targets?state=active")["data"]["activeTargets"]
            rules = get_json(port, "/api/v1/rules")["data"]["groups"]
            diagnose = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", "--prometheus",
                                       f"http://127.0.0.1:{port}", *QUERY_TIMEOUT], capture_output=True, text=True,
                                      timeout=600)
            held.append({"jobs": sorted({t["labels"]["job"] for t in targets}),
                         "series": get_json(port, "/api/v1/status/tsdb")["data"]["headStats"]["numSeries"],
                         "evaluation": {group["name"]: group["evaluationTime"] for group in rules},
                         "diagnose": (diagnose.stdout + diagnose.stderr).strip()})
    finally:
        end(processes, server)
    return {**judged(jobs, named), "servers": held, "seconds": fired_after_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--shards", type=int, default=3, help="Prometheus servers sharing the jobs")
    args = parser.parse_args()
    if args.shards < 1:
        parser.error(f"--shards {args.shards} is not accepted: give 1 or more")
    missing = [name for name in ("prometheus", "prometheus-alertmanager") if shutil.which(name) is None]
    if missing:
        print(f"bench/shards.py needs {', '.join(missing)} on PATH (Debian: apt-get install prometheus "
              "prometheus-alertmanager)", file=sys.stderr)
        return 2
    text = template()
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory(prefix="commlens-shards-") as folder:
            result = measure(text, ranks, args.shards, pathlib.Path(folder))
        print(f"{ranks:,} ranks, {args.shards} Prometheus servers sharded by job; alerts read "
              f"{result['seconds']:.0f} s after the start")
        for shard, held in enumerate(result["servers"]):
            groups = ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in held["evaluation"].items())
            print(f"  server {shard}: jobs {', '.join(held['jobs']) or 'none'}; {held['series']:,} series; "
                  f"rule groups: {groups}")
        print_verdicts(result)
        for shard, held in enumerate(result["servers"]):
            print(f"  commlens diagnose --prometheus <server {shard}>: " + held["diagnose"].replace("\n", "\n    "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
