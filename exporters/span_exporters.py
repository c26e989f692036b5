"""Span exporters, as OpenTelemetry's SDK shapes them: each sends one batch of spans already encoded
(``otlp.BatchSpanProcessor`` builds and batches them), over OTLP/gRPC, OTLP/HTTP with protobuf bodies, or
as lines of OTLP JSON in a file (the embedded default), and returns a ``SpanExportResult``; none raises.

Example::

    exporter = HttpSpanExporter("http://collector:4318/v1/traces", timeout_s=5)
    exporter.export(request, within_s=2.0)    # SpanExportResult.SUCCESS or .FAILURE
"""

from __future__ import annotations

import ssl
import urllib.parse
import urllib.request
from typing import Any, Protocol

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExportResult


class SpanExporter(Protocol):
    """Sends one batch of spans (OpenTelemetry's ``SpanExporter``, on requests already encoded):
    ``form`` says which encoding ``export`` takes, "protobuf" (an ``ExportTraceServiceRequest``) or
    "json" (OTLP JSON text)."""

    form: str

    def export(self, request: Any, within_s: float) -> SpanExportResult:
        """Send ``request`` within ``within_s`` (and the exporter's own timeout); never raises."""

    def shutdown(self) -> None: ...


class GrpcSpanExporter:
    """OTLP/gRPC to ``endpoint`` (``http://`` or insecure: plaintext; ``https://``: TLS)."""

    form = "protobuf"

    def __init__(self, endpoint: str, headers: tuple = (), timeout_s: float = 10.0, insecure: bool = False,
                 certificate: str | None = None):
        import grpc
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

        url = urllib.parse.urlsplit(endpoint)
        target = f"{url.hostname}:{url.port or 4317}"
        if url.scheme == "http" or insecure:
            self._channel = grpc.insecure_channel(target)
        else:
            roots = open(certificate, "rb").read() if certificate else None
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(roots))
        self._export = TraceServiceStub(self._channel).Export
        self.timeout_s, self.metadata = timeout_s, tuple(headers)

    def export(self, request: ExportTraceServiceRequest, within_s: float) -> SpanExportResult:
        try:
            self._export(request, timeout=min(self.timeout_s, within_s), metadata=self.metadata)
        except Exception:  # grpc.RpcError: unavailable, deadline exceeded, refused
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._channel.close()


class HttpSpanExporter:
    """OTLP/HTTP with protobuf bodies, POSTed to the full traces URL."""

    form = "protobuf"

    def __init__(self, endpoint: str, headers: tuple = (), timeout_s: float = 10.0, certificate: str | None = None):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.headers = {"Content-Type": "application/x-protobuf", **dict(headers)}
        self._tls = ssl.create_default_context(cafile=certificate) if endpoint.startswith("https") else None

    def export(self, request: ExportTraceServiceRequest, within_s: float) -> SpanExportResult:
        post = urllib.request.Request(self.endpoint, data=request.SerializeToString(), headers=self.headers,
                                      method="POST")
        try:
            with urllib.request.urlopen(post, timeout=min(self.timeout_s, within_s), context=self._tls) as response:
                response.read()
        except (OSError, ValueError):  # refused, timed out, an HTTP error status (urllib's HTTPError)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class JsonLinesSpanExporter:
    """The embedded default: each export request appended to ``path`` as one line of OTLP JSON."""

    form = "json"

    def __init__(self, path: str):
        self.path = path
        open(path, "a").close()  # fail now, at start-up, if the file cannot be written

    def export(self, request: str, within_s: float) -> SpanExportResult:
        try:
            with open(self.path, "a") as f:
                f.write(request + "\n")
        except OSError:  # a full disk, a removed folder
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass
