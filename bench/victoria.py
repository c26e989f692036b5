"""The shipped rules past one Prometheus: sharded vmagents, VictoriaMetrics and vmalert, on the simulated
job of ``bench/scale.py``.

``bench/scale.py``'s simulated jobs (``faulty_jobs``: a late rank and a NaN origin, a straggler, a node
that becomes unreachable), served as there, are scraped every 10 s by ``--agents``
vmagents in cluster mode (``-promscrape.cluster.membersCount``: each scrapes its share of the targets),
which write to one VictoriaMetrics; vmalert evaluates ``deploy/prometheus-rules.yaml`` as ``commlens assets
--scrape-interval 10s`` writes it against it, writes the recorded series and alert states back, and notifies a real Alertmanager. Everything from
Debian's ``victoria-metrics`` and ``prometheus-alertmanager``. Printed per size: whether each alert names
its culprit and only it (as on Prometheus), the other alerts firing, each rule group's evaluation time,
and what ``commlens diagnose --prometheus`` says when it reads VictoriaMetrics' Prometheus API.

    python bench/victoria.py [--ranks 1000 10000] [--agents 2]
"""

from __future__ import annotations

import argparse
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

from commlens.agent.cli.ports import free_ports  # noqa: E402

COMPONENTS = ("victoria-metrics", "vmagent", "vmalert", "prometheus-alertmanager")
QUERY_TIMEOUT = ("--query-timeout", "60")
"""``commlens diagnose``'s, as docs/scale.md advises for a store loaded by thousands of ranks: at 10 s (the
default) its queries timed out on a loaded host at 10,000 ranks, and at 264 beside CI's other tests."""
INTERVAL_S = 10


def get_json(port: int, path: str) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60).read())


def wait_ready(port: int, path: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing answered at 127.0.0.1:{port}{path} within {timeout_s:.0f} s") from None
            time.sleep(0.5)


def measure(text: str, ranks: int, agents: int, out: pathlib.Path, interval_s: int = INTERVAL_S) -> dict:
    """One size: the stack started on ``ranks`` simulated ranks, scraped and evaluated every ``interval_s``,
    until every expected alert fires (after 9 intervals at least: the rest may fire too) or 60 intervals."""
    jobs = faulty_jobs(text, ranks)
    train = jobs[0]
    server = serve(jobs)
    base = free_ports(3 + agents)
    vm, alertmanager, vmalert, *agent_ports = range(base, base + 3 + agents)
    scrape = {"global": {"scrape_interval": f"{interval_s}s", "scrape_timeout": f"{interval_s}s"},
              "scrape_configs": [{"job_name": job.name, "static_configs": [
                  {"targets": [f"127.0.0.1:{server.server_port}"],
                   "labels": {"__metrics_path__": f"/metrics/{job.name}/{t}", "instance": f"pod-{job.first_node + t}"}}
                  for t in range(len(job.targets))]} for job in jobs]}
    (out / "scrape.yml").write_text(json.dumps(scrape))
    (out / "alertmanager.yml").write_text(json.dumps({"route": {"receiver": "none"}, "receivers": [{"name": "none"}]}))
    logs = open(out / "components.log", "w")
    processes = []

    def start(*argv: str) -> None:
        processes.append(subprocess.Popen(argv, stdout=logs, stderr=subprocess.STDOUT))

    try:
        start("victoria-metrics", f"-storageDataPath={out / 'vm'}", f"-httpListenAddr=127.0.0.1:{vm}",
              "-retentionPeriod=1d", "-search.latencyOffset=1s", "-search.disableCache")
        start("prometheus-alertmanager", f"--config.file={out / 'alertmanager.yml'}",
              f"--storage.path={out / 'am'}", f"--web.listen-address=127.0.0.1:{alertmanager}",
              "--cluster.listen-address=")
        wait_ready(vm, "/health")
        wait_ready(alertmanager, "/-/ready")
        for member, port in enumerate(agent_ports):
            start("vmagent", f"-promscrape.config={out / 'scrape.yml'}", f"-httpListenAddr=127.0.0.1:{port}",
                  f"-promscrape.cluster.membersCount={agents}", f"-promscrape.cluster.memberNum={member}",
                  f"-remoteWrite.url=http://127.0.0.1:{vm}/api/v1/write",
                  f"-remoteWrite.tmpDataPath={out / f'vmagent-{member}'}")
        start("vmalert", f"-rule={rules_at(interval_s, out)}", f"-httpListenAddr=127.0.0.1:{vmalert}",
              f"-datasource.url=http://127.0.0.1:{vm}", f"-remoteWrite.url=http://127.0.0.1:{vm}",
              f"-remoteRead.url=http://127.0.0.1:{vm}", f"-notifier.url=http://127.0.0.1:{alertmanager}",
              f"-evaluationInterval={interval_s}s")
        wait_ready(vmalert, "/api/v1/alerts")
        named, deadline = {}, time.monotonic() + 60 * interval_s  # left at once when every alert is in
        while time.monotonic() < deadline:
            time.sleep(interval_s)
            named = firing(get_json(vmalert, "/api/v1/alerts")["data"]["alerts"] or ())
            if all(name in named for name in EXPECTED) and time.monotonic() - train.started > 9 * interval_s:
                break
        fired_after_s = time.monotonic() - train.started
        evaluation = {group["name"]: sum(rule["evaluationTime"] for rule in group["rules"])  # one after another
                      for group in get_json(vmalert, "/api/v1/rules")["data"]["groups"]}
        series = int(json.loads(urllib.request.urlopen(
            f"http://127.0.0.1:{vm}/api/v1/series/count", timeout=60).read())["data"][0])
        diagnose = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", "--prometheus",
                                   f"http://127.0.0.1:{vm}", "--job", "train", *QUERY_TIMEOUT], capture_output=True,
                                  text=True, timeout=600)
    finally:
        end(processes, server)
    return {**judged(jobs, named), "evaluation": evaluation, "series": series, "seconds": fired_after_s,
            "diagnose": (diagnose.stdout + diagnose.stderr).strip()}


def end(processes: list[subprocess.Popen], server) -> None:
    """Stop the stack's processes and the simulated jobs' server."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait()
    server.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--agents", type=int, default=2, help="vmagents sharing the targets (cluster mode)")
    args = parser.parse_args()
    missing = [name for name in COMPONENTS if shutil.which(name) is None]
    if missing:
        print(f"bench/victoria.py needs {', '.join(missing)} on PATH (Debian: apt-get install victoria-metrics "
              "prometheus-alertmanager)", file=sys.stderr)
        return 2
    text = template()
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory(prefix="commlens-victoria-") as folder:
            result = measure(text, ranks, args.agents, pathlib.Path(folder))
        groups = ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in result["evaluation"].items())
        print(f"{ranks:,} ranks, {args.agents} vmagents: {result['series']:,} series in VictoriaMetrics; vmalert's "
              f"rule groups: {groups}; alerts read {result['seconds']:.0f} s after the start")
        print_verdicts(result)
        print("  commlens diagnose --prometheus <VictoriaMetrics> --job train: "
              + result["diagnose"].replace("\n", "\n    "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
