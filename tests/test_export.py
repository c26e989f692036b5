"""Spans to real OTLP receivers over gRPC and HTTP; a dead or silent collector; bad configuration."""

import collections
import json
import socket

import pytest
import torch
import torch.distributed as dist

import commlens.agent
from commlens.agent import Config, ConfigError
from ports import free_port
from commlens.exporters.telemetry import Collective
from commlens.exporters.otlp import BatchSpanProcessor
from commlens.exporters.span_exporters import GrpcSpanExporter, HttpSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult
from receivers import GrpcReceiver, HttpReceiver, span_attributes, spans_of


def traced_job(rank, world_size, endpoints):
    protocol, endpoint = endpoints[rank % 2]
    commlens.agent.start(Config.from_env({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "COMMLENS_METRICS_PORT": "0", "COMMLENS_JOB_ID": "job-7",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_HEADERS": "x-team=infra", "OTEL_SERVICE_NAME": "trainer"}))
    pair = dist.new_group([0, 1])
    for _ in range(4):
        dist.all_reduce(torch.ones(256))
    dist.broadcast(torch.ones(8), src=0)
    if rank < 2:
        dist.all_reduce(torch.ones(16, dtype=torch.float64), group=pair)
    commlens.agent.stop()
    return dist.distributed_c10d._get_process_group_name(pair)


def test_spans_reach_real_receivers_over_grpc_and_http_and_share_one_trace_per_collective(run_ranks):
    grpc_receiver, http_receiver = GrpcReceiver(), HttpReceiver()
    try:
        pair = run_ranks(traced_job, 3, endpoints=[("grpc", grpc_receiver.endpoint),
                                                   ("http/protobuf", http_receiver.endpoint)])[0]
    finally:
        grpc_receiver.close()
        http_receiver.close()
    assert set(http_receiver.paths) == {"/v1/traces"}
    assert all(h.get("x-team") == "infra" for h in grpc_receiver.headers)
    assert all(h.get("x-team") == "infra" for h in http_receiver.headers)
    by_protocol = {"grpc": spans_of(grpc_receiver.requests), "http": spans_of(http_receiver.requests)}
    assert {span_attributes(s)["commlens.rank"] for _, s in by_protocol["grpc"]} == {0, 2}
    assert {span_attributes(s)["commlens.rank"] for _, s in by_protocol["http"]} == {1}

    collectives = collections.defaultdict(dict)
    for resource, span in by_protocol["grpc"] + by_protocol["http"]:
        a = span_attributes(span)
        assert resource["service.name"] == "trainer" and resource["commlens.job"] == "job-7"
        assert span.name == a["commlens.op"] and a["commlens.status"] == "ok" and a["commlens.world_size"] == 3
        assert span.end_time_unix_nano >= span.start_time_unix_nano > 0
        collectives[(a["commlens.pg.name"], a["commlens.seq"])][a["commlens.rank"]] = (span.trace_id, a)

    default = sorted(seq for pg, seq in collectives if pg == "0")
    assert default == list(range(1, 6))  # 4 all_reduce and a broadcast, numbered as c10d numbers them
    for (pg, seq), ranks in collectives.items():
        assert set(ranks) == ({0, 1, 2} if pg == "0" else {0, 1})
        assert len({trace for trace, _ in ranks.values()}) == 1  # one trace for the collective, all ranks
        a = next(iter(ranks.values()))[1]
        if pg == pair:
            assert (a["commlens.op"], a["commlens.bytes"], a["commlens.dtype"], a["commlens.pg.size"]) == \
                ("all_reduce", 128, "Double", 2)
        elif seq <= 4:
            assert (a["commlens.op"], a["commlens.bytes"], a["commlens.dtype"], a["commlens.pg.size"]) == \
                ("all_reduce", 1024, "Float", 3)
            assert a["commlens.busbw_bytes_per_s"] > 0
        else:
            assert (a["commlens.op"], a["commlens.bytes"]) == ("broadcast", 32)
    assert len(collectives) == 6


def _collective(i):
    return Collective("all_reduce", "0", 2, i, False, i, 0, 4096, "Float", False, "ok", 1, 2, 1.0, False, False,
                      False, False)


def test_the_trace_files_json_is_protobufs_own_json_mapping_of_the_spans():
    import base64

    from google.protobuf.json_format import MessageToDict

    every_field = _collective(7)._replace(status="error", nan=True, inf=True, hang=True, slow=True,
                                      busbw=float("inf"), bucket=2, last_bucket=True, wire_bytes=2048,
                                      module="model.0", phase="backward", gpu_start_ns=1, in_flight=True)
    exporter = BatchSpanProcessor(_Kept(), {"service.name": "trainer", "commlens.rank": 0, "x": 0.5}, job="j")
    collectives = (_collective(0), every_field, _collective(1)._replace(gpu_start_ns=1, module="m", phase="forward"))
    written = json.loads(exporter.json_request([exporter.builder.json(c) for c in collectives]))
    expected = MessageToDict(exporter.request(collectives), use_integers_for_enums=True)
    exporter.shutdown(1)
    for span in expected["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        span["traceId"], span["spanId"] = (base64.b64decode(span[k]).hex() for k in ("traceId", "spanId"))
    for request in (written, expected):  # span ids are random, drawn anew for each encoding
        for span in request["resourceSpans"][0]["scopeSpans"][0]["spans"]:
            assert len(bytes.fromhex(span.pop("spanId"))) == 8
    assert written == expected
    assert written["resourceSpans"][0]["scopeSpans"][0]["spans"][1]["status"]["code"] == 2  # an error


def restarted_agent(rank, world_size, folder):
    for run, collectives in enumerate((3, 4)):
        commlens.agent.start(Config.from_env({
            "RANK": str(rank), "WORLD_SIZE": str(world_size), "COMMLENS_METRICS_PORT": "0",
            "OTEL_TRACES_SAMPLER": "always_on", "COMMLENS_TRACE_FILE": f"{folder}/run-{run}-{{rank}}.jsonl"}))
        for _ in range(collectives):
            dist.all_reduce(torch.ones(8))
        commlens.agent.stop()


def test_an_agent_started_again_in_the_process_exports_only_the_collectives_after_the_last_one(run_ranks, tmp_path):
    run_ranks(restarted_agent, 2, folder=str(tmp_path))
    for rank in range(2):
        seqs = [sorted(int(a["value"]["intValue"]) for line in (tmp_path / f"run-{run}-{rank}.jsonl").read_text().splitlines()
                       for spans in json.loads(line)["resourceSpans"] for scope in spans["scopeSpans"]
                       for span in scope["spans"] for a in span["attributes"] if a["key"] == "commlens.seq")
                for run in range(2)]
        assert seqs == [[1, 2, 3], [4, 5, 6, 7]]


def test_beside_training_the_trace_file_gets_every_span(tmp_path):
    from commlens.exporters.span_exporters import JsonLinesSpanExporter

    path = tmp_path / "traces.jsonl"
    exporter = BatchSpanProcessor(JsonLinesSpanExporter(str(path)), {}, job="j", beside_training=True)
    for i in range(20):
        exporter.queue(_collective(i))
    exporter.shutdown(10)
    lines = [json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"] for line in path.read_text().splitlines()]
    assert exporter.counts["exported"] == 20
    assert sorted(int(a["value"]["intValue"]) for spans in lines for span in spans for a in span["attributes"]
                  if a["key"] == "commlens.seq") == list(range(20))


class _Kept:
    form = "protobuf"

    def export(self, request, within_s):
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


def test_a_dead_collector_costs_counted_spans_and_never_blocks_the_producer():
    exporter = BatchSpanProcessor(GrpcSpanExporter(f"http://127.0.0.1:{free_port()}", timeout_s=1.0), {}, job="j",
                            queue_size=100, batch_size=10)
    for i in range(300):
        exporter.queue(_collective(i))
    exporter.shutdown(30)
    counts = exporter.counts
    assert counts["exported"] == 0 and counts["failed"] >= 1 and counts["failed"] + counts["dropped"] == 300


def test_a_collector_that_accepts_and_never_answers_costs_counted_spans():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections complete in the backlog; nothing ever answers
    try:
        exporter = BatchSpanProcessor(HttpSpanExporter(f"http://127.0.0.1:{silent.getsockname()[1]}/v1/traces",
                                              timeout_s=1.0), {}, job="j", queue_size=100, batch_size=10)
        for i in range(300):
            exporter.queue(_collective(i))
        exporter.shutdown(30)
    finally:
        silent.close()
    counts = exporter.counts
    assert counts["exported"] == 0 and counts["dropped"] >= 190 and counts["failed"] + counts["dropped"] == 300


def stops_against_a_silent_collector(rank, world_size, endpoint):
    import time

    agent = commlens.agent.start(Config.from_env({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "COMMLENS_METRICS_PORT": "0",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc" if rank == 0 else "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_SAMPLER": "always_on", "OTEL_EXPORTER_OTLP_TIMEOUT": "60000", "COMMLENS_SNAPSHOT_TIMEOUT_S": "2"}))
    for _ in range(3000):
        dist.all_reduce(torch.ones(4))
    dist.barrier()
    started = time.monotonic()
    commlens.agent.stop()
    with agent.sidecar.stats.lock:
        completed = sum(agent.sidecar.stats.completed.values())
    return time.monotonic() - started, completed, dict(agent.spans.counts)


def test_stop_is_bounded_by_the_snapshot_timeout_against_a_silent_collector_and_every_span_is_counted(run_ranks):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # connections complete in the backlog; nothing ever answers, over gRPC or HTTP
    try:
        results = run_ranks(stops_against_a_silent_collector, 2, endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}")
    finally:
        silent.close()
    for stop_s, completed, counts in results:
        assert stop_s < 2 + 1, stop_s  # the snapshot timeout, not the collector's 60 s, bounds it
        assert counts.get("exported", 0) == 0 and counts["failed"] > 0
        assert sum(counts.values()) == completed >= 3001  # every collective's span: exactly one result


@pytest.mark.parametrize("variable, value, accepted", [
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", "grpc, http/protobuf"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317", "http://collector:4318"),
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:43x7", "numeric port"),
    ("COMMLENS_HANG_THRESHOLD_S", "-5", ">= 0.1"),
    ("COMMLENS_METRICS_PORT", "70000", "<= 65535"),
    ("OTEL_TRACES_SAMPLER", "sometimes", "traceidratio"),
    ("COMMLENS_DRAIN_INTERVAL_MS", "5000", "<= 1000"),
    ("COMMLENS_METRICS_DETAIL", "everything", "group, op, full"),
    ("OTEL_METRICS_EXPORTER", "otlp,statsd", "prometheus, otlp, none"),
    ("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "sometimes", "cumulative, delta, lowmemory"),
    ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "collector:4317", "http://collector:4318"),
    ("COMMLENS_RING_SLOTS", "1000", "power of two"),
    ("COMMLENS_RING_PATH", "/no/such/folder/ring-{rank}", "existing folder"),
    ("COMMLENS_RING_PATH", "/tmp/ring-{local}", "{rank} is replaced"),
    ("TORCHELASTIC_RESTART_COUNT", "-1", ">= 0"),
])
def test_bad_configuration_fails_at_start_up_naming_variable_value_and_what_is_accepted(variable, value, accepted):
    with pytest.raises(ConfigError) as refused:
        Config.from_env({variable: value})
    message = str(refused.value)
    assert variable in message and repr(value) in message and accepted in message


def test_a_metrics_port_in_use_fails_at_start_up(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ConfigError) as refused:
            commlens.agent.start(Config.from_env({
                "COMMLENS_METRICS_PORT": str(port), "COMMLENS_METRICS_ADDR": "127.0.0.1",
                "COMMLENS_TRACE_FILE": str(tmp_path / "spans.jsonl")}))
    finally:
        taken.close()
    assert "COMMLENS_METRICS_PORT" in str(refused.value) and f"127.0.0.1:{port}" in str(refused.value)
    assert commlens.agent.current() is None


def test_the_way_down_waits_for_a_scrape_that_starts_after_it_not_one_under_way():
    """A scrape under way when a sidecar begins its way down read the values before its last drain (CI:
    a pod sidecar stopped on that scrape, and the killed rank's last collectives never reached
    Prometheus): ``wait_for_scrape`` returns on a scrape that starts after it is called."""
    import threading

    from commlens.exporters.prometheus import _Scrapes

    class Metrics(_Scrapes):
        def families(self):
            yield "a family"

    metrics = Metrics()
    list(metrics.collect())  # scraped before
    under_way = metrics.collect()
    next(under_way)  # a scrape started, its values read, its response not yet sent
    waited = []
    way_down = threading.Thread(target=lambda: waited.append(metrics.wait_for_scrape(30)))
    way_down.start()
    while not metrics.scraped._waiters:  # until the way down waits: a condition polled, not a sleep
        threading.Event().wait(0.001)
    list(under_way)
    way_down.join(0.5)
    assert way_down.is_alive() and waited == []  # the scrape under way does not count
    list(metrics.collect())
    way_down.join(30)
    assert waited == [True]


def _up_served():
    """A collector of one gauge (``commlens_test_up 1``) served on a free port: (collector, port, server)."""
    from prometheus_client.core import GaugeMetricFamily

    from commlens.exporters.prometheus import _Scrapes, serve

    class Metrics(_Scrapes):
        def families(self):
            yield GaugeMetricFamily("commlens_test_up", "a family", value=1)

    metrics, port = Metrics(), free_port()
    return metrics, port, serve(metrics, "127.0.0.1", port)


def test_a_scrape_is_served_when_no_thread_can_be_started_for_it(monkeypatch):
    """From its atexit handlers on, Python 3.12 starts no thread: a rank whose main thread reached its
    end while its SIGTERM snapshot waits for a scrape (``agent/signals.py``) serves that scrape on the
    server's own thread instead, or the snapshot is never scraped and the rank is named killed."""
    import threading
    import urllib.request

    metrics, port, server = _up_served()
    started = threading.Thread.start

    def refused(thread):
        if thread._target == server.process_request_thread:
            raise RuntimeError("can't create new thread at interpreter shutdown")
        started(thread)

    monkeypatch.setattr(threading.Thread, "start", refused)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            assert b"commlens_test_up 1.0" in response.read()
        with metrics.scraped:  # counted done once the server has flushed it, which the client may read before
            assert metrics.scraped.wait_for(lambda: metrics.done == 1, 30)
    finally:
        monkeypatch.undo()
        server.shutdown()
        server.server_close()


def test_the_way_down_waits_for_a_scrape_sent_in_time_not_one_its_scraper_may_have_given_up_on():
    """CI: a rank told to stop answered its last scrape later than Prometheus' timeout (8 ranks writing
    their dumps on 2 loaded cores), so Prometheus recorded its endpoint down without the snapshot that
    said it was told to stop, and the rank was named killed. A scrape whose response took over half the
    timeout its scraper states does not end the wait."""
    import threading
    import urllib.request

    from commlens.exporters.prometheus import SCRAPE_TIMEOUT_HEADER

    metrics, port, server = _up_served()

    def scrape(timeout_s: str | None) -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
        if timeout_s is not None:
            request.add_header(SCRAPE_TIMEOUT_HEADER, timeout_s)
        with urllib.request.urlopen(request, timeout=30) as response:
            assert b"commlens_test_up 1.0" in response.read()

    try:
        scrape(None)  # scraped before
        waited = []
        way_down = threading.Thread(target=lambda: waited.append(metrics.wait_for_scrape(30)))
        way_down.start()
        while not metrics.scraped._waiters:  # until the way down waits: a condition polled, not a sleep
            threading.Event().wait(0.001)
        scrape("0.000000001")  # a scraper that gave up before any response could reach it
        way_down.join(0.5)
        assert way_down.is_alive() and waited == []
        scrape("30")
        way_down.join(30)
        assert waited == [True]
    finally:
        server.shutdown()
        server.server_close()
