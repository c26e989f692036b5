"""Several nodes on this machine, for the multi-node tests and benchmarks: each node a network
namespace with its own address on a bridge, its own host name (a UTS namespace) and its own CPU
cgroup, so that gloo, torchrun and Prometheus see separate hosts; its faults are a host's: a link cut
or rate-limited, the CPU throttled, every process killed. Needs root (``ip netns``); names unique per
run, so that parallel runs cannot collide, and everything removed on the way out whatever happened.

Example::

    with Nodes(3) as nodes:
        job = nodes.start(0, ["python", "-c", "import socket; print(socket.gethostname())"], log=path)
        nodes.cut(1)            # node 1's link down: unreachable from the others and from Prometheus
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import signal
import subprocess
import time

from monitoring import end_session

CGROUP_CPU = "/sys/fs/cgroup/cpu"


def why_not() -> str | None:
    """Why nodes cannot be made here (no root, no ``ip``), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here (Debian's iproute2)"
    if not os.path.isfile(os.path.join(CGROUP_CPU, "cpu.cfs_quota_us")):
        return f"no cgroup v1 cpu controller at {CGROUP_CPU} (the nodes' CPU shares)"
    return None


def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", *args] if namespace is None else ["ip", "netns", "exec", namespace, "ip", *args]
    subprocess.run(command, check=True, capture_output=True, text=True)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no interface of this machine is on."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    while True:
        second, third = secrets.randbelow(156) + 100, secrets.randbelow(256)
        if f"inet 10.{second}.{third}." not in used:
            return ipaddress.IPv4Network(f"10.{second}.{third}.0/24")


class Nodes:
    """``count`` nodes named ``node-0`` ... (host names), at ``address(k)``; ``start`` runs a command on one."""

    def __init__(self, count: int):
        self.token = secrets.token_hex(2)
        self.count = count
        self.subnet = _free_subnet()
        self.bridge = f"clb{self.token}"
        self.processes: dict[int, list[subprocess.Popen]] = {k: [] for k in range(count)}
        self._made: list[tuple[str, str]] = []

    def name(self, k: int) -> str:
        return f"node-{k}"

    def namespace(self, k: int) -> str:
        return f"commlens-{self.token}-{k}"

    def interface(self, k: int) -> str:
        """The node's own end of its link (inside its namespace)."""
        return f"cln{self.token}{k}"

    def _host_end(self, k: int) -> str:
        return f"clh{self.token}{k}"

    def _cgroup(self, k: int) -> str:
        return os.path.join(CGROUP_CPU, self.namespace(k))

    def address(self, k: int) -> str:
        return str(self.subnet.network_address + k + 1)

    @property
    def gateway(self) -> str:
        """The host's address on the nodes' bridge: where a node reaches a server of the host's."""
        return str(self.subnet.network_address + 254)

    def __enter__(self) -> Nodes:
        try:
            gateway = f"{self.gateway}/{self.subnet.prefixlen}"
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("addr", "add", gateway, "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for k in range(self.count):
                namespace, inside, outside = self.namespace(k), self.interface(k), self._host_end(k)
                _ip("netns", "add", namespace)
                self._made.append(("netns", namespace))
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                self._made.append(("link", outside))
                _ip("link", "set", inside, "netns", namespace)
                _ip("link", "set", outside, "master", self.bridge)
                _ip("link", "set", outside, "up")
                _ip("addr", "add", f"{self.address(k)}/{self.subnet.prefixlen}", "dev", inside, namespace=namespace)
                _ip("link", "set", inside, "up", namespace=namespace)
                _ip("link", "set", "lo", "up", namespace=namespace)
                os.mkdir(self._cgroup(k))
                self._made.append(("cgroup", self._cgroup(k)))
        except BaseException:
            self.__exit__()
            raise
        return self

    def start(self, k: int, command: list[str], log, env: dict | None = None) -> subprocess.Popen:
        """``command`` on node ``k``: in its namespace, under its host name and CPU cgroup, in a
        process group of its own; output to ``log`` (a path)."""
        # it waits for a line on stdin, written once it is in the cgroup (a namespace's /sys has none)
        shell = f'read go && hostname {self.name(k)} && exec "$@" < /dev/null'
        with open(log, "a") as output:
            process = subprocess.Popen(
                ["ip", "netns", "exec", self.namespace(k), "unshare", "--uts", "sh", "-c", shell, "sh", *command],
                env={**os.environ, "GLOO_SOCKET_IFNAME": self.interface(k), **(env or {})}, stdin=subprocess.PIPE,
                stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[k].append(process)
        with open(os.path.join(self._cgroup(k), "cgroup.procs"), "w") as procs:
            procs.write(str(process.pid))
        process.stdin.write(b"go\n")
        process.stdin.close()
        return process

    def cut(self, k: int) -> None:
        """Node ``k``'s link down: nothing reaches it, and it reaches nothing."""
        _ip("link", "set", self._host_end(k), "down")

    def kill(self, k: int) -> None:
        """SIGKILL every process on node ``k`` (a host that vanished), again until none is left that a
        fork in the meantime made."""
        while pids := self._pids(k):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if pids == self._pids(k):  # killed, not yet reaped: leaving is ``_rmdir_when_empty``'s wait
                return

    def _pids(self, k: int) -> list[int]:
        with open(os.path.join(self._cgroup(k), "cgroup.procs")) as procs:
            return [int(pid) for pid in procs.read().split()]

    def throttle(self, k: int, share: float) -> None:
        """Node ``k``'s processes get ``share`` of one CPU (cgroup v1's CFS quota)."""
        with open(os.path.join(self._cgroup(k), "cpu.cfs_period_us")) as period:
            quota = int(int(period.read()) * share)
        with open(os.path.join(self._cgroup(k), "cpu.cfs_quota_us"), "w") as f:
            f.write(str(quota))

    def limit(self, k: int, rate: str) -> None:
        """Node ``k``'s link limited to ``rate`` (``tc``'s units: ``8mbit``) both ways (token bucket)."""
        for device, namespace in ((self._host_end(k), None), (self.interface(k), self.namespace(k))):
            command = ["tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", "32kbit",
                       "latency", "400ms"]
            if namespace is not None:
                command = ["ip", "netns", "exec", namespace, *command]
            subprocess.run(command, check=True, capture_output=True, text=True)

    def __exit__(self, *exc) -> None:
        """Everything made is removed, each step whatever the others did; the first failure raised last."""
        failures: list[BaseException] = []
        for k, processes in self.processes.items():
            try:
                for process in processes:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                if os.path.isdir(self._cgroup(k)):
                    self.kill(k)  # a process that left its group (a daemon) goes too
                for process in processes:
                    process.wait()
            except Exception as error:  # noqa: BLE001 — the namespaces and links must still go
                failures.append(error)
        for kind, name in reversed(self._made):
            try:
                if kind == "cgroup":
                    _rmdir_when_empty(name)
                elif kind == "netns":
                    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=True)
                else:
                    subprocess.run(["ip", "link", "del", name], capture_output=True, check=True)
            except Exception as error:  # noqa: BLE001
                failures.append(error)
        if failures:
            raise failures[0]


def _rmdir_when_empty(path: str, timeout_s: float = 10.0) -> None:
    """rmdir a cgroup once the processes killed in it have left it (they leave when reaped: polled,
    since cgroup v1 tells no one); a cgroup left behind after ``timeout_s`` is the harness' failure."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(path)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class NodeJob:
    """``commlens run --sidecar -- torchrun`` of ``script`` on every node of ``nodes`` (``per_node``
    ranks each, node 0 the rendezvous), as a cluster runs one job: a pod sidecar per node serving
    metrics on ``address:port``, dumps in ``out/node-<k>``, traces there too or to the OTLP endpoint
    ``spans_to``. ``targets``: what Prometheus scrapes (``monitoring.Prometheus`` takes it as a job)."""

    def __init__(self, nodes: Nodes, out, script: str, args: list[str], per_node: int = 2,
                 hang_threshold_s: float = 3, port: int = 9464, env: dict | None = None, spans_to: str | None = None):
        import sys

        self.nodes, self.out, self.port = nodes, out, port
        self.targets = [f"{nodes.address(k)}:{port}" for k in range(nodes.count)]
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        self.processes = []
        for k in range(nodes.count):
            folder = out / f"node-{k}"
            folder.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", "commlens.agent.cli", "run", "--sidecar", "--job-id", "multi-node",
                       "--hang-threshold", str(hang_threshold_s), "--metrics-port", str(port),
                       "--metrics-addr", "0.0.0.0",
                       *(["--otlp-endpoint", spans_to] if spans_to else ["--trace-file", str(folder / "traces-{rank}.jsonl")]),
                       "--",
                       torchrun, "--nnodes", str(nodes.count), "--node-rank", str(k),
                       "--nproc-per-node", str(per_node), "--master-addr", nodes.address(0),
                       "--master-port", "29500", script, *args]
            self.processes.append(nodes.start(k, command, out / f"node-{k}.log",
                                              {"TORCHCOMM_FR_DUMP_TEMP_FILE": str(folder / "rank_"), **(env or {})}))

    def wait(self, timeout_s: float) -> list[int]:
        return [process.wait(timeout_s) for process in self.processes]

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            end_session(process, 30)
