"""The shipped alert rules, end to end: the demo with an injected fault, scraped by a real Prometheus
that evaluates deploy/prometheus-rules.yaml and sends to a real Alertmanager, which delivers to a
webhook in the test."""

import contextlib
import pathlib

from monitoring import Alertmanager, Demo, Prometheus, Webhook, wait_for

RULES = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "prometheus-rules.yaml"
WORLD = 3


@contextlib.contextmanager
def _stack(tmp_path, inject):
    with Webhook() as webhook, Alertmanager(tmp_path, webhook.url) as alertmanager, \
            Demo(tmp_path, WORLD, steps=4, inject=inject) as demo, \
            Prometheus(tmp_path, demo.targets, [RULES], alertmanager.address) as prometheus:
        yield webhook, demo, prometheus


def test_a_nan_on_one_rank_fires_the_nan_alert_naming_that_rank(tmp_path):
    # at the last step: earlier, the all-reduce would spread it into every rank's next step
    with _stack(tmp_path, ["nan:rank=1:step=3"]) as (webhook, demo, prometheus):
        demo.wait_serving()
        wait_for(lambda: webhook.firing("CommlensNaNDetected"), "the NaN alert at the webhook")
        wait_for(lambda: prometheus.query('ALERTS{alertname="CommlensNaNDetected", alertstate="firing"}'),
                 "Prometheus to list the alert")  # everything it fires has reached Alertmanager by now
        alerts = webhook.firing("CommlensNaNDetected")
    assert {a["labels"]["rank"] for a in alerts} == {"1"}, alerts
    assert {a["labels"]["op"] for a in alerts} <= {"all_reduce"}
    assert all(a["labels"]["pg"] == "0" and "on rank 1 (group 0" in a["annotations"]["summary"] for a in alerts)


def test_a_hang_fires_the_hang_alert_with_group_and_seq_and_the_lag_alert_naming_the_rank_that_never_joined(
        tmp_path):
    # rank 2 stalls at step 2 long enough for the lag rule (a minute without progress, then 30 s)
    with _stack(tmp_path, ["hang:rank=2:step=2:s=150"]) as (webhook, demo, prometheus):
        hung = wait_for(lambda: webhook.firing("CommlensCollectiveHung"), "the hang alert", timeout_s=60)
        lagging = wait_for(lambda: webhook.firing("CommlensRankLagging"), "the lag alert", timeout_s=150)
        enqueued = prometheus.by_rank('commlens_collective_last_seq{state="enqueued", pg="0"}')
    # ranks 0 and 1 wait in the collectives they issued (the broadcast's root can stop a collective
    # short of a receiver); rank 2 never joined
    assert enqueued[2] < min(enqueued[0], enqueued[1])
    assert {a["labels"]["rank"] for a in hung} <= {"0", "1"} and hung
    for alert in hung:
        rank = int(alert["labels"]["rank"])
        assert alert["labels"]["pg"] == "0" and alert["labels"]["op"] in ("broadcast", "all_reduce")
        assert f"hung in group 0 at seq {enqueued[rank]:g} on rank {rank}" in alert["annotations"]["summary"]
    assert {a["labels"]["rank"] for a in lagging} == {"2"}
    behind = max(enqueued.values()) - enqueued[2]
    assert lagging[0]["annotations"]["summary"].startswith(f"Rank 2 is {behind:g} collectives behind group 0")
