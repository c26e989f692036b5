"""Where telemetry goes, built from a ``Config``: the span processor and its exporter, the OTLP
metrics pusher, and the metrics endpoint.

Shared by the in-process agent (agent/runtime.py) and the pod sidecar (agent/pod.py), which builds
one per local rank; imports no torch.

Example::

    spans = span_processor(config)     # OTLP over gRPC or HTTP, or the trace file when no endpoint is set
    spans.queue(collective)
    pusher = metrics_pusher(config, collector.families)   # None unless OTEL_METRICS_EXPORTER lists otlp
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Iterable

from commlens.exporters import names
from commlens.exporters.otlp import BatchSpanProcessor
from commlens.exporters.span_exporters import GrpcSpanExporter, HttpSpanExporter, JsonLinesSpanExporter, SpanExporter
from commlens.exporters.otlp_metrics import MetricsPusher
from commlens.exporters.prometheus import serve
from commlens.ring.dumps import attempt_path

from .config import Config, ConfigError


def span_processor(config: Config, beside_training: bool = False) -> BatchSpanProcessor:
    """``beside_training``: the processor runs in the training process (``BatchSpanProcessor``)."""
    return BatchSpanProcessor(span_exporter(config), resource(config), config.job, config.world_size,
                              config.sampler_ratio, config.sampler.endswith("always_off"), config.span_queue,
                              budget_per_s=config.span_budget_per_s, beside_training=beside_training,
                              attempt=config.attempt)


def span_exporter(config: Config) -> SpanExporter:
    """OTLP over gRPC or HTTP to the configured endpoint; without one, the trace file (the attempt's)."""
    if config.otlp_endpoint is None:
        path = attempt_path(config.trace_file.format(rank=config.rank), config.attempt)
        try:
            if config.attempt:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            return JsonLinesSpanExporter(path)
        except OSError as error:
            raise ConfigError(f"COMMLENS_TRACE_FILE={config.trace_file!r}: cannot write {path!r} "
                              f"({error.strerror}); give a writable path ({{rank}} is replaced)") from None
    if config.otlp_protocol == "grpc":
        return GrpcSpanExporter(config.otlp_endpoint, config.otlp_headers, config.otlp_timeout_s,
                                config.otlp_insecure, config.otlp_certificate)
    return HttpSpanExporter(config.otlp_endpoint, config.otlp_headers, config.otlp_timeout_s, config.otlp_certificate)


def resource(config: Config) -> dict:
    """``service.name``, ``host.name``, ``OTEL_RESOURCE_ATTRIBUTES`` and Kubernetes attributes, by
    OpenTelemetry's rules."""
    from opentelemetry.sdk.resources import Resource

    own = {names.JOB: config.job, names.RANK: config.rank, names.ATTEMPT: config.attempt,
           "host.name": socket.gethostname()}
    for variable, key in (("K8S_POD_NAME", "k8s.pod.name"), ("K8S_NAMESPACE_NAME", "k8s.namespace.name"),
                          ("K8S_NODE_NAME", "k8s.node.name")):
        if os.environ.get(variable):
            own[key] = os.environ[variable]
    own.update(config.resource_attributes)
    own["service.name"] = config.service_name or own.get("service.name", "commlens")
    return dict(Resource.create(own).attributes)


def metrics_pusher(config: Config, families: Callable[[], Iterable[Any]]) -> MetricsPusher | None:
    """A started pusher of ``families`` over OTLP, every ``OTEL_METRIC_EXPORT_INTERVAL``; None when
    OTLP metrics are not asked for."""
    if config.otlp_metrics_endpoint is None:
        return None
    endpoint, headers = config.otlp_metrics_endpoint, dict(config.otlp_headers)
    if config.otlp_metrics_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc

        insecure = config.otlp_insecure or endpoint.startswith("http://")
        exporter = Grpc(endpoint=endpoint, insecure=insecure, headers=headers, timeout=config.otlp_timeout_s)
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

        exporter = Http(endpoint=endpoint, headers=headers, timeout=config.otlp_timeout_s,
                        certificate_file=config.otlp_certificate)
    shared = {k: v for k, v in resource(config).items() if k != names.RANK}  # every series names its rank
    pusher = MetricsPusher(families, exporter, shared, config.metrics_delta, config.otlp_timeout_s)
    pusher.start(config.metrics_interval_s)
    return pusher


class MetricsOut:
    """A collector's ways out: served on the configured address and port (none without one), pushed over
    OTLP where asked. ``stop`` pushes the last values and waits, until ``deadline``, for a last scrape.
    A port that cannot be served is a ``ConfigError`` that asks for ``port_hint``."""

    def __init__(self, config: Config, collector: Any, port_hint: str):
        self.collector, self.server = collector, None
        if config.metrics_port is not None:
            try:
                self.server = serve(collector, config.metrics_addr, config.metrics_port)
            except OSError as error:
                raise ConfigError(f"COMMLENS_METRICS_PORT: cannot serve metrics on {config.metrics_addr}:"
                                  f"{config.metrics_port} ({error.strerror}); choose {port_hint}, or 0 to serve "
                                  "none") from None
        self.pusher = metrics_pusher(config, collector.families)

    def stop(self, deadline: float) -> None:
        """The last push and scrape (until ``deadline``, a ``time.monotonic()``), then serve no more."""
        if self.pusher is not None:
            self.pusher.shutdown(max(0.1, deadline - time.monotonic()))
        self.collector.wait_for_scrape(max(0.0, deadline - time.monotonic()))
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
