"""The alerts on a job's health and on commlens' own losses (agent/verdicts/rules/health.yaml) fire end
to end: an ordinary job under ``commlens run``, Debian's Prometheus on the shipped rules."""

import os
import pathlib
import signal

import pytest

from commlens.agent.verdicts.catalogue import HEALTH
from commlens.exporters import names
from monitoring import Prometheus, TrainingJob, wait_for, wait_training
from ports import free_port

RULES = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "prometheus-rules.yaml"


@pytest.mark.long
def test_records_lost_in_the_ring_spans_lost_on_the_way_out_and_a_frozen_rank_each_fire_their_alert(tmp_path):
    """A ring of 16 slots overflows when the script all_reduces 256 metrics at once, each its own async
    op, every 10 steps (the sidecar thread, woken as a quarter of the ring fills, gets no GIL while the
    training thread issues them: the job's own ring of 65536 slots holds them); spans go to an OTLP
    endpoint nobody listens on; once both losses are alerted, rank 0 freezes (the test stops it with SIGSTOP,
    as a stuck host would: its endpoint no longer answers, its connections stay open) while ranks 1 and 2
    wait on it until the backend's timeout, and stay scraped: over a minute, as CommlensTargetDown holds
    for 1 min (a scrape or two missed is no target down).
    (CommlensLossScaleSkipping and CommlensBusBandwidthDrop hold for 5 and 10 min: promtool's cases fire
    them, and ``bench/slow_alerts.py`` once end to end.)"""
    losses = {"COMMLENS_RING_SLOTS": "16", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
              "OTEL_EXPORTER_OTLP_TIMEOUT": "1000"}
    with TrainingJob(tmp_path, 3, "none", steps=100_000, extra=["--timeout-s", "150", "--metrics", "256"],
                     env=losses, start_now=False) as job, Prometheus(tmp_path, job, [RULES]) as prometheus:
        job.start()
        wait_training(prometheus, job)

        def firing(alert: str) -> set[str]:
            return {a["metric"]["rank"] for a in prometheus.query(f'ALERTS{{alertname="{alert}", alertstate="firing"}}')}

        def seen() -> str:
            counted = {name: prometheus.by_rank(f"sum by (rank) ({name}_total)")
                       for name in (names.RING_RECORDS_DROPPED, names.SPANS_EXPORTED)}
            return f"firing: {({alert: firing(alert) for alert in HEALTH})}; counted: {counted}; the job {job.state()}"

        wait_for(lambda: firing("CommlensRingRecordsDropped") == firing("CommlensSpansLost") == {"0", "1", "2"},
                 "every rank's lost records and spans alerted", 90, seen)
        frozen = job.rank_pid(0)
        os.kill(frozen, signal.SIGSTOP)
        try:
            wait_for(lambda: firing("CommlensTargetDown") == {"0"}, "rank 0's metrics alerted gone", 90, seen)
            assert job.process.poll() is None, "the job ended: its other ranks are no longer scraped"
        finally:  # torchrun's SIGTERM waits while it is stopped, and torchrun is killed before it gives up
            os.kill(frozen, signal.SIGKILL)
