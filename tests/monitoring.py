"""The real monitoring stack for the tests: the demo serving metrics, Debian's Prometheus and
Alertmanager on loopback, and a webhook receiver that Alertmanager delivers to.

Example::

    with Demo(tmp_path, world=3, steps=6, inject=["nan:rank=1:step=5"]) as demo, \\
            Prometheus(tmp_path, demo) as prometheus:
        demo.wait_serving()
        wait_for(lambda: prometheus.query("commlens_info"), "the first scrape")
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

from commlens.agent.verdicts.catalogue import KINDS
from commlens.exporters import names
from ports import free_port, free_ports
from receivers import serve_posts


def installed(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: CI installs Debian's prometheus and prometheus-alertmanager (.ci/run)"
    return path


def promtool(*args: str, cwd=None, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([installed("promtool"), *args], capture_output=True, text=True, cwd=cwd, input=input)


STARTUP_S = 300
"""How long a wait that takes in a job's start-up gets: imports, process groups, the model take over a
minute on a loaded 2-core host (torch 2.15.0 beside the suite's heaviest tests). A wait that times what
the job does once started keeps ``wait_for``'s 90 s."""


def wait_for(condition, what: str, timeout_s: float = 90, explain=None):
    """Poll ``condition`` until it returns something true (a server still starting counts as false);
    on timeout the failure carries what ``explain()`` returns (the evidence that was there)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = condition()
        except OSError:
            found = None
        if found:
            return found
        if time.monotonic() >= deadline:
            evidence = f"; {explain()}" if explain else ""
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}{evidence}")
        time.sleep(0.25)


def wait_training(prometheus: Prometheus, job: TrainingJob, timeout_s: float = STARTUP_S) -> None:
    """Wait out the job's start-up (imports, process groups, the model: over a minute on a loaded 2-core
    host) until Prometheus holds a completed collective of every rank, or the job's fault came first:
    a test's wait for what the job then does measures that alone."""
    def trained() -> bool:
        ranks = prometheus.query(f"count(count by (rank) ({names.COLLECTIVES}_total > 0))")
        return bool(ranks) and int(ranks[0]["value"][1]) == job.world
    wait_for(lambda: job.fault_at() or trained(), "every rank's first collectives scraped", timeout_s,
             explain=lambda: f"the job {job.state()}; its log ends: {job.log.read_text()[-3000:]}")


def culprits(report: str) -> set[int]:
    """The ranks that the findings of ``commlens diagnose`` blame (a finding of every kind that names ranks:
    its title, then its ranks; a node's and the network's name the node or nobody)."""
    titles = "|".join(re.escape(kind.title) for kind in KINDS)
    found = re.findall(rf"(?:{titles}) ranks? ([\d, ]+) in", report)
    return {int(rank) for ranks in found for rank in ranks.split(",")}


def end_session(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM to the process group ``process`` leads; SIGKILL after ``timeout_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


class Demo:
    """``commlens demo --keep-serving`` in its own process group; metrics on ``base + rank``."""

    def __init__(self, tmp_path, world: int, steps: int, inject=(), env=None):
        self.world, self.base, self.out = world, free_ports(world), tmp_path / "demo"
        command = [sys.executable, "-m", "commlens.agent.cli", "demo", "--world-size", str(world), "--steps",
                   str(steps), "--out", str(self.out), "--keep-serving"]
        for fault in inject:
            command += ["--inject", fault]
        self.process = subprocess.Popen(
            command, env={**os.environ, "COMMLENS_METRICS_PORT": str(self.base), "MASTER_PORT": str(free_port()),
                          **(env or {})},
            stdout=subprocess.PIPE, stderr=open(tmp_path / "demo.log", "w"), text=True, start_new_session=True)
        self.targets = [f"127.0.0.1:{self.base + rank}" for rank in range(world)]

    def wait_serving(self) -> None:
        """Block until every rank has finished training and serves its final metrics."""
        serving = 0
        while serving < self.world:
            line = self.process.stdout.readline()
            assert line, "the demo ended before serving its metrics"
            serving += line.count("serving metrics until SIGTERM or Ctrl-C")

    def result(self, rank: int) -> dict:
        return json.loads((self.out / f"result-rank{rank}.json").read_text())

    def __enter__(self) -> Demo:
        return self

    def __exit__(self, *exc) -> None:
        end_session(self.process, 60)


SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faulty_train.py")
PARALLEL_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel_train.py")
MATRIX_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "matrix_train.py")


class TrainingJob:
    """``commlens run -- torchrun`` of ``tests/faulty_train.py`` (an ordinary training script with a
    fault written into it) in its own process group: metrics on ``base + rank``, traces and dumps in
    ``out``; the wall time of the fault in ``out/fault_time``."""

    def __init__(self, tmp_path, world: int, fault: str, rank: int = 1, step: int = 100, steps: int = 1000,
                 hang_threshold_s: float = 3, extra=(), pod: bool = False, ring_dir=None, script: str = SCRIPT,
                 start_now: bool = True, env=None):
        """``pod``: with ``commlens run --sidecar`` (one metrics target); ``ring_dir``: the ranks write
        their rings there for a ``PodSidecar`` the test runs (and serve no metrics themselves);
        ``script``: another training script that takes the same options (``tests/parallel_train.py``);
        ``start_now``: False to ``start()`` it later (once a Prometheus scrapes its targets); ``env``: more
        of the job's environment (commlens' configuration)."""
        self.world, self.base, self.out = world, free_ports(world), tmp_path / "job"
        self.store = f"127.0.0.1:{free_ports(1)}"
        """The job's store (torchrun's), as ``commlens dump`` takes it."""
        self.log = tmp_path / "job.log"
        self.out.mkdir(exist_ok=True)
        self.fault_time = self.out / "fault_time"
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        options = ["--sidecar"] if pod else ["--in-process"]
        if ring_dir is not None:
            options += ["--ring-dir", str(ring_dir)]
        command = [sys.executable, "-m", "commlens.agent.cli", "run", "--hang-threshold", str(hang_threshold_s),
                   "--metrics-port", str(self.base), "--metrics-addr", "127.0.0.1", "--job-id", "verdict-test",
                   "--trace-file", str(self.out / "traces-{rank}.jsonl"), *options, "--",
                   torchrun, "--nproc-per-node", str(world), "--master-port", self.store.split(":")[1], script,
                   "--fault", fault, "--rank", str(rank), "--step", str(step), "--steps", str(steps), *extra]
        self._command, self._env, self.process, self.script = command, env or {}, None, script
        self.targets = [f"127.0.0.1:{self.base + rank}" for rank in range(1 if pod else world)]
        if start_now:
            self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            self._command, env={**os.environ, "TORCHCOMM_FR_DUMP_TEMP_FILE": str(self.out / "rank_"),
                                "FAULT_TIME_FILE": str(self.fault_time), **self._env},
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def fault_at(self) -> float | None:
        """The wall time at which the fault happened, once it has."""
        return float(self.fault_time.read_text()) if self.fault_time.exists() else None

    def rank_pid(self, rank: int) -> int:
        """The process id of the training script's ``rank``: the descendant of the job that torchrun
        started with ``RANK=<rank>`` (torchrun puts each worker in a session of its own)."""
        parents = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/stat") as f:
                    parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        for pid in parents:
            ancestor = parents[pid]
            while ancestor not in (0, 1, self.process.pid):
                ancestor = parents.get(ancestor, 0)
            if ancestor != self.process.pid:
                continue
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().split(b"\0")
                if f"RANK={rank}".encode() in environ and self.script.encode() in command:
                    return pid
        raise AssertionError(f"no process of rank {rank} under the job's {self.process.pid}")

    def wait(self, timeout_s: float) -> int:
        return self.process.wait(timeout_s)

    def state(self) -> str:
        """"running", "not started" or "exited with N"."""
        if self.process is None:
            return "not started"
        code = self.process.poll()
        return "running" if code is None else f"exited with {code}"

    def __enter__(self) -> TrainingJob:
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            end_session(self.process, 30)


class PodSidecar:
    """``commlens sidecar`` on ``ring_dir`` in its own process, metrics on loopback at ``port``, dumps
    as ``out/rank_<rank>``, as a Kubernetes sidecar container beside the training one."""

    def __init__(self, tmp_path, ring_dir, out, hang_threshold_s: float = 3, port: int | None = None):
        self.port = port or free_ports(1)
        self.log_path = tmp_path / f"sidecar-{self.port}.log"
        self.log = open(self.log_path, "a")
        command = [sys.executable, "-m", "commlens.agent.cli", "sidecar", "--ring-dir", str(ring_dir),
                   "--metrics-port", str(self.port), "--metrics-addr", "127.0.0.1",
                   "--hang-threshold", str(hang_threshold_s), "--trace-file", str(out / "traces-{rank}.jsonl")]
        self.process = subprocess.Popen(command, env={**os.environ, "TORCHCOMM_FR_DUMP_TEMP_FILE": str(out / "rank_")},
                                        stdout=self.log, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        return self.log_path.read_text()

    def text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as response:
            return response.read().decode()

    def samples(self, name: str) -> dict[tuple, float]:
        """``name``'s samples now: labels (sorted pairs) -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(self.text())
                for s in family.samples if s.name == name}

    def by_rank(self, name: str, **labels) -> dict[int, float]:
        return {int(dict(key)["rank"]): value for key, value in self.samples(name).items()
                if all(dict(key).get(k) == v for k, v in labels.items())}

    def __enter__(self) -> PodSidecar:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:  # it ignored SIGTERM: a failure, but it must not outlive the test
                self.process.kill()
                self.process.wait()
                raise
        self.log.close()


class _Server:
    def __init__(self, command: list[str]):
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(30)


class Prometheus(_Server):
    """Debian's Prometheus scraping ``job``'s targets (a ``Demo`` or a ``TrainingJob``) every second (or
    ``scrape_interval``) as job "commlens" (exemplars kept), evaluating ``rule_files`` as often, sending alerts to
    ``alertmanager`` (host:port) if given. On the way out it stops ``job`` first, as a cluster's
    Prometheus outlives a job: the ranks' last scrape on the way down comes within a second, instead
    of their waiting the whole snapshot timeout for a Prometheus already gone."""

    def __init__(self, tmp_path, job: Demo | TrainingJob, rule_files=(), alertmanager: str | None = None,
                 scrape_interval: str = "1s", query_log: bool = False):
        """``query_log``: Prometheus logs each query it is asked (``queries``)."""
        self.port, self.job = free_ports(1), job
        self.query_log = tmp_path / "queries.log" if query_log else None
        config = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval,
                             **({"query_log_file": str(self.query_log)} if query_log else {})},
                  "rule_files": [str(path) for path in rule_files],
                  "scrape_configs": [{"job_name": "commlens", "static_configs": [{"targets": job.targets}]}]}
        if alertmanager:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        super().__init__([installed("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}",
                          "--enable-feature=exemplar-storage"])

    def query(self, expression: str, at: float | None = None) -> list[dict]:
        params = {"query": expression, **({"time": repr(at)} if at is not None else {})}
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.load(response)["data"]["result"]

    def exemplars(self, expression: str, seconds: float = 600) -> list[dict]:
        """The exemplars of ``expression``'s series over the last ``seconds``."""
        now = time.time()
        params = {"query": expression, "start": repr(now - seconds), "end": repr(now)}
        url = f"http://127.0.0.1:{self.port}/api/v1/query_exemplars?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as response:
            return [e for series in json.load(response)["data"] for e in series["exemplars"]]

    def by_rank(self, expression: str) -> dict[int, float]:
        return {int(r["metric"]["rank"]): float(r["value"][1]) for r in self.query(expression)}

    def queries(self) -> list[dict]:
        """The parameters of each query asked over the HTTP API so far (query, start, end: RFC 3339), from
        the query log; not the rules' own."""
        entries = [json.loads(line) for line in self.query_log.read_text().splitlines()]
        return [entry["params"] for entry in entries if "httpRequest" in entry]

    def __exit__(self, *exc) -> None:
        self.job.__exit__(*exc)
        super().__exit__(*exc)


class Webhook:
    """An HTTP receiver for Alertmanager's webhook: ``alerts`` holds every alert it was sent."""

    def __init__(self):
        self.alerts: list[dict] = []
        self.server = serve_posts(lambda path, headers, body: self.alerts.extend(json.loads(body)["alerts"]))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"

    def firing(self, alertname: str) -> list[dict]:
        return [a for a in list(self.alerts) if a["labels"]["alertname"] == alertname and a["status"] == "firing"]

    def __enter__(self) -> Webhook:
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class Alertmanager(_Server):
    """Debian's Alertmanager on loopback, delivering every alert to ``webhook_url`` at once."""

    def __init__(self, tmp_path, webhook_url: str):
        self.port = free_ports(1)
        config = {"route": {"receiver": "test", "group_by": ["..."], "group_wait": "0s", "group_interval": "1s",
                            "repeat_interval": "1h"},
                  "receivers": [{"name": "test", "webhook_configs": [{"url": webhook_url}]}]}
        (tmp_path / "alertmanager.yml").write_text(json.dumps(config))
        self.address = f"127.0.0.1:{self.port}"
        super().__init__([installed("prometheus-alertmanager"), f"--config.file={tmp_path / 'alertmanager.yml'}",
                          f"--storage.path={tmp_path / 'alertmanager'}", f"--web.listen-address={self.address}",
                          "--cluster.listen-address="])
