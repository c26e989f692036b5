"""``commlens sidecar``: one process per pod that reads the rings of every local rank in a shared
folder, follows each rank across restarts and deaths, and runs for all of them what the in-process
thread runs for one, with one Prometheus endpoint for the pod. See docs/running.md ("One sidecar per
pod").

Example::

    pod = PodSidecar(Config.from_env(), "/dev/shm/commlens")
    pod.start()      # serves metrics; drains as a rank's ring fills a quarter, and every drain interval
    ...
    pod.stop()       # drains what is left, flushes spans
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
import threading
import time
from typing import Callable

from commlens.exporters.prometheus import MetricsCollector, PodCollector
from commlens.ring.dumps import dump_ring
from commlens.ring.memory import RING_FILES, Ring
from commlens.ring.wakeups import WakeFiles

from .config import Config
from .outputs import MetricsOut
from .pipeline import RankPipeline, dump_entries, writer_info
from .sidecar import Sidecar

ATTEMPT_FLUSH_S = 2.0
"""The longest a rank's last attempt's spans are waited for, once torchrun has restarted the rank."""


class RankFeed:
    """One rank as the pod sidecar follows it: its pipeline (counters, spans and metrics, which
    outlive the process and the ring of any one run of the rank) and whether its process lives."""

    def __init__(self, config: Config, info: dict, on_hang: Callable[[RankFeed], None]):
        self.info, self.on_hang = info, on_hang
        self.pipeline = self._pipeline(config)
        self.alive = False

    def _pipeline(self, config: Config) -> RankPipeline:
        return RankPipeline(config, self._info, lambda: self.on_hang(self), on_snapshot=self.dump)

    @property
    def sidecar(self) -> Sidecar | None:
        return self.pipeline.sidecar

    def follow(self, ring: Ring) -> None:
        """Read ``ring`` from now on (the rank's first, or a restarted rank's new one). A ring of the job's
        next attempt (an elastic restart) starts the rank's telemetry again, as a restarted process does
        its own: counters from 0, its spans and dumps in that attempt's files (``Config.attempt``), once
        the last attempt's spans are sent (``ATTEMPT_FLUSH_S`` at most)."""
        attempt = self.info.get("attempt", 0)
        if attempt != self.pipeline.config.attempt:
            self.pipeline.stop(ATTEMPT_FLUSH_S)
            self.pipeline = self._pipeline(dataclasses.replace(self.pipeline.config, attempt=attempt))
        sidecar = self.pipeline.follow(ring)
        self.alive = ring.writer_alive()
        if not self.alive and not ring.closed:  # found killed (before this sidecar started, or saw it)
            sidecar.drain()
            self.dump("exit")

    def drain(self) -> None:
        """Drain the ring; when the rank's process has just ended without closing it, dump it (``exit``)."""
        sidecar = self.sidecar
        if sidecar is None:
            return
        sidecar.drain()
        was_alive, self.alive = self.alive, sidecar.ring.writer_alive()  # a rank may close and reopen it
        if was_alive and not self.alive:
            sidecar.drain()
            sidecar.writer_ended()
            if not sidecar.ring.closed:
                self.dump("exit")

    def dump(self, reason: str) -> str | None:
        """Write this rank's flight-recorder dump from its ring and count it; the path, or None."""
        ring = self.sidecar.ring
        return self.pipeline.write_dump(reason, lambda: dump_ring(ring, dump_entries(ring)))

    def _info(self) -> dict:
        backend = self.sidecar.shapes.backend if self.sidecar is not None else ""
        return writer_info(self.pipeline.config, backend=backend or "unknown", version=self.info.get("version", "unknown"))


class PodSidecar:
    """Follows every ring in ``ring_dir`` (see the module's docstring); ``config`` gives the hang
    threshold, the exporters' settings and the metrics port (one port: ``LOCAL_RANK`` is not added)."""

    def __init__(self, config: Config, ring_dir: str):
        self.config, self.ring_dir = config, ring_dir
        self.feeds: dict[int, RankFeed] = {}
        """Rank -> its feed, for every rank seen."""
        self._paths: dict[str, int] = {}
        """Ring file -> the inode of the ring read from it."""
        self._unreadable: set[tuple[str, int]] = set()
        self.errors = 0
        """Drains that failed (the loop went on)."""
        self._lock = threading.Lock()
        self._ending = threading.Event()  # stop() was called: the loop ends once no rank's process lives
        self._stop = threading.Event()  # the loop ends now
        self._wakes = WakeFiles()  # each rank's ring file's FIFO: it wakes the loop as the ring fills a quarter
        self._thread: threading.Thread | None = None
        self.collector = PodCollector(self._metrics, self._up)
        self.metrics_out = MetricsOut(config, self.collector, "a free port")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="commlens-pod-sidecar", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Follow the ranks until every one's process has ended, then drain every ring, flush spans and
        wait for a last scrape, each within the snapshot timeout (``timeout_s``). A pod's containers are
        told to stop together, and ``commlens run``'s sidecar shares its process group: a rank stopped
        at the same time asks for its ``signal`` dump, or dies, after this process was told to end."""
        timeout_s = self.config.snapshot_timeout_s if timeout_s is None else timeout_s
        self._ending.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.stop_waiting()
        if self._thread is not None:
            self._thread.join(timeout_s)
        deadline = time.monotonic() + timeout_s
        self.poll()
        if self._thread is None or not self._thread.is_alive():
            self._wakes.close()
        for feed in list(self.feeds.values()):
            feed.pipeline.spans.shutdown(max(0.0, deadline - time.monotonic()))
        self.metrics_out.stop(deadline)

    def stop_waiting(self) -> None:
        """Let ``stop`` go on without waiting for the ranks still alive (a second signal)."""
        self._stop.set()
        self._wakes.set()

    def _run(self) -> None:
        interval_s = min(self.config.drain_interval_s, self.config.hang_threshold_s / 4)
        while not self._stop.is_set():
            try:
                self._wakes.wait(interval_s)
                if self._stop.is_set():
                    return
                self.poll()
            except Exception as error:  # noqa: BLE001 — the loop goes on: a frozen sidecar hides every hang
                self.errors += 1
                if self.errors == 1:
                    print(f"commlens sidecar: a drain failed ({error!r}); going on, later failures are only "
                          "counted", file=sys.stderr)
                self._stop.wait(interval_s)  # and not at once again
            if self._ending.is_set() and not any(feed.alive for feed in list(self.feeds.values())):
                return

    def poll(self) -> None:
        """One pass: attach to new and replaced rings, then drain every rank's."""
        with self._lock:
            self._scan()
            for feed in list(self.feeds.values()):
                feed.drain()

    def _scan(self) -> None:
        for path in sorted(glob.glob(os.path.join(self.ring_dir, RING_FILES))):
            try:
                inode = os.stat(path).st_ino
            except FileNotFoundError:
                continue
            if self._paths.get(path) == inode or (path, inode) in self._unreadable:
                continue
            try:
                ring = Ring.attach(path)
            except (OSError, ValueError) as error:
                self._unreadable.add((path, inode))
                print(f"commlens sidecar: cannot read {path}: {error}", file=sys.stderr)
                continue
            info = ring.info()
            if "rank" not in info:
                continue  # its writer has not described it yet: the next pass
            feed = self.feeds.get(info["rank"])
            if feed is None:
                config = dataclasses.replace(self.config, rank=info["rank"], local_rank=info.get("local_rank", 0),
                                             world_size=info.get("world_size", 1), job=info.get("job", self.config.job),
                                             attempt=info.get("attempt", 0))
                feed = self.feeds[info["rank"]] = RankFeed(config, info, self._hang)
            feed.info = info
            self._wakes.watch(path)
            feed.follow(ring)
            self._paths[path] = inode

    def _hang(self, feed: RankFeed) -> None:
        """A rank's collective crossed the hang threshold: its dump, and every other local rank's."""
        feed.dump("hang")
        for other in list(self.feeds.values()):
            if other is not feed and other.sidecar is not None:
                other.dump("peer")

    def _metrics(self) -> list[MetricsCollector]:
        return [feed.pipeline.metrics for _, feed in sorted(self.feeds.items())]

    def _up(self) -> dict[str, bool]:
        return {str(rank): feed.alive for rank, feed in self.feeds.items()}
