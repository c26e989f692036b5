"""Every rank dumps when any rank sees a hang or an abort: it adds one to ``commlens/<job>/dumps`` in
the job's c10d store, and a daemon thread in every rank polls that counter over a store connection
of its own and has its rank write its dump; ``commlens dump`` asks from outside. See docs/running.md.

Example::

    dumps = JobDumps("job-42", period_s=1.0, dump=lambda: agent.snapshot("peer"))
    dumps.request()          # this rank saw a hang: every rank dumps within period_s
    dumps.stop()
    request_dumps("10.0.0.5:29500", "job-42")   # from anywhere that reaches the job's store
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, Callable


class JobDumps:
    """Started with the agent, before or after ``init_process_group``: it connects to the default
    group's store once there is one."""

    def __init__(self, job: str, period_s: float, dump: Callable[[], None]):
        self.key, self.period_s, self.dump = f"commlens/{job}/dumps", period_s, dump
        self.store: Any = None
        self.errors = 0
        self._seen = -1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commlens-job-dumps", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # before finalization: a store call cut short there aborts the process

    def request(self) -> None:
        """Ask every rank of the job, this one excepted, to write its dump."""
        with self._lock:
            if self._connect():
                self._seen = max(self._seen, self._add(self.store, 1))

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._stop.set()
        self._thread.join(self.period_s + 1)

    def _connect(self) -> bool:
        """Open our own connection to the default group's store, once it exists."""
        if self.store is None:
            store = _default_store(max(10.0, 4 * self.period_s))
            if store is None:
                return False
            self.store, self._seen = store, self._add(store, 0)
        return True

    def _add(self, store: Any, count: int) -> int:
        """The job's counter once ``count`` is added; -1, counted in ``errors``, when the store is gone
        (the job is ending)."""
        try:
            return store.add(self.key, count)
        except Exception:  # noqa: BLE001
            self.errors += 1
            return -1

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with self._lock:
                if not self._connect():
                    continue
                current = self._add(self.store, 0)
                grew = current > self._seen >= 0
                self._seen = max(self._seen, current)
            if grew:
                self.dump()


def request_dumps(store: str, job: str, timeout_s: float = 10.0) -> None:
    """Ask every rank of ``job`` for its flight-recorder dump through the job's store at ``store``
    (``host:port``: its ranks' ``MASTER_ADDR:MASTER_PORT``); each writes it within a second or so.
    Raises ``ValueError`` for an address that is not ``host:port``, ``ConnectionError`` when nothing
    listens there."""
    import socket

    host, _, port = store.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--store {store!r} is not accepted: give the job's store as HOST:PORT "
                         "(its ranks' MASTER_ADDR:MASTER_PORT)")
    try:  # refused or unreachable: said at once, without the store client's retries
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise ConnectionError(f"no store answered at {store} ({error.strerror or error}); give the job's "
                              "MASTER_ADDR:MASTER_PORT") from None
    _client(host, int(port), timeout_s).add(f"commlens/{job}/dumps", 1)


def _default_store(timeout_s: float) -> Any:
    """A client of the default process group's store of our own; None before ``init_process_group``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):  # the training thread's connection is not shared
        store = _client(store.host, store.port, timeout_s)
    return store


def _client(host: str, port: int, timeout_s: float) -> Any:
    """A connection of our own to the TCPStore server at ``host:port``."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
