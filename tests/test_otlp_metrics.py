"""OTLP metrics: the same metrics as the Prometheus endpoint, pushed to real receivers over gRPC and HTTP."""

import collections
import urllib.request

import pytest
import torch
import torch.distributed as dist

import commlens.agent
from commlens.agent.config import Config
from ports import free_ports

from receivers import GrpcReceiver, HttpReceiver

ALL_REDUCES = 40


def train_and_push(rank, world_size, endpoint, protocol, temporality, base_port, trace_file):
    agent = commlens.agent.start(Config.from_env({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "COMMLENS_JOB_ID": "otlp-job",
        "COMMLENS_METRICS_ADDR": "127.0.0.1", "COMMLENS_METRICS_PORT": str(base_port), "COMMLENS_TRACE_FILE": trace_file,
        "OTEL_METRICS_EXPORTER": "prometheus,otlp", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": protocol, "OTEL_METRIC_EXPORT_INTERVAL": "100",
        "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": temporality}))
    for half in range(2):  # an export between the halves: the last push carries new collectives
        for _ in range(ALL_REDUCES // 2):
            dist.all_reduce(torch.ones(256))
        agent.sidecar.drain()
        if half == 0:
            agent.metrics_out.pusher.export(timeout_s=5)
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{base_port + rank}/metrics", timeout=10).read().decode()
    commlens.agent.stop()  # one last push
    return "commlens_collectives_total" in scraped, dict(agent.metrics_out.pusher.counts)


def _points(requests):
    """(metric name, rank) -> the data points received, in order; and the resources seen."""
    points, resources = collections.defaultdict(list), []
    for request in requests:
        for rm in request.resource_metrics:
            resources.append({kv.key: kv.value.string_value for kv in rm.resource.attributes})
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    kind = metric.WhichOneof("data")
                    for point in getattr(metric, kind).data_points:
                        attrs = {kv.key: kv.value.string_value for kv in point.attributes}
                        points[(metric.name, attrs.get("rank"))].append((kind, getattr(metric, kind), attrs, point))
    return points, resources


def _number(point):
    return getattr(point, point.WhichOneof("value"))


@pytest.mark.parametrize("protocol,temporality", [("grpc", "cumulative"), ("http/protobuf", "delta")])
def test_the_metrics_arrive_over_otlp_with_the_contracts_names_beside_the_prometheus_endpoint(
        run_ranks, tmp_path, protocol, temporality):
    receiver = GrpcReceiver("metrics") if protocol == "grpc" else HttpReceiver("metrics")
    endpoint = receiver.endpoint + ("" if protocol == "grpc" else "/v1/metrics")
    try:
        results = run_ranks(train_and_push, 2, endpoint=endpoint, protocol=protocol, temporality=temporality,
                            base_port=free_ports(2), trace_file=str(tmp_path / "spans-{rank}.jsonl"))
    finally:
        receiver.close()
    points, resources = _points(receiver.requests)
    assert all(resource["commlens.job"] == "otlp-job" and "commlens.rank" not in resource for resource in resources)
    names = {name for name, _ in points}
    assert {"commlens_collective_duration_seconds", "commlens_collectives", "commlens_collective_bytes",
            "commlens_collective_last_seq", "commlens_hangs", "commlens_nan_events", "commlens_info"} <= names
    for rank, (served, counts) in enumerate(results):
        assert served and counts.get("exported", 0) >= 2 and counts.get("failed", 0) == 0, counts
        completed = points[("commlens_collectives", str(rank))]
        durations = points[("commlens_collective_duration_seconds", str(rank))]
        assert all(kind == "sum" and data.is_monotonic for kind, data, _, _ in completed)
        assert all(attrs["op"] == "all" and attrs["status"] == "ok" for _, _, attrs, _ in completed)
        if temporality == "cumulative":
            assert _number(completed[-1][3]) == ALL_REDUCES and durations[-1][3].count == ALL_REDUCES
        else:  # the changes add up to the whole
            assert sum(_number(p) for _, _, _, p in completed) == ALL_REDUCES
            assert sum(p.count for _, _, _, p in durations) == ALL_REDUCES
        last = durations[-1][3]
        assert len(last.bucket_counts) == len(last.explicit_bounds) + 1 and list(last.explicit_bounds) == sorted(
            last.explicit_bounds)
        seq = points[("commlens_collective_last_seq", str(rank))]
        assert max(_number(p) for kind, _, _, p in seq if kind == "gauge") == ALL_REDUCES
