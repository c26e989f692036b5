"""Real OTLP receivers on loopback, built from opentelemetry-proto: gRPC (grpcio) and HTTP/protobuf, for
traces (the default) or metrics."""

from __future__ import annotations

import http.server
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

SERVICES = {  # signal -> (request, response, servicer base, registration)
    "traces": (trace_service_pb2.ExportTraceServiceRequest, trace_service_pb2.ExportTraceServiceResponse,
               trace_service_pb2_grpc.TraceServiceServicer, trace_service_pb2_grpc.add_TraceServiceServicer_to_server),
    "metrics": (metrics_service_pb2.ExportMetricsServiceRequest, metrics_service_pb2.ExportMetricsServiceResponse,
                metrics_service_pb2_grpc.MetricsServiceServicer,
                metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server),
}


def spans_of(requests) -> list[tuple[dict, object]]:
    """(resource attributes, span) for every span of the requests."""
    found = []
    for request in requests:
        for resource_spans in request.resource_spans:
            resource = {kv.key: _plain(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                found.extend((resource, span) for span in scope_spans.spans)
    return found


def span_attributes(span) -> dict:
    return {kv.key: _plain(kv.value) for kv in span.attributes}


def _plain(value):
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


class GrpcReceiver:
    def __init__(self, signal: str = "traces", host: str = "127.0.0.1"):
        _, response, base, register = SERVICES[signal]
        self.requests, self.headers = [], []
        receiver = self

        class Servicer(base):
            def Export(self, request, context):  # noqa: N802 (the service's method name)
                receiver.requests.append(request)
                receiver.headers.append(dict(context.invocation_metadata()))
                return response()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        register(Servicer(), self.server)
        self.port = self.server.add_insecure_port(f"{host}:0")
        self.endpoint = f"http://{host}:{self.port}"
        self.server.start()

    def close(self):
        self.server.stop(None)


def serve_posts(handle) -> http.server.ThreadingHTTPServer:
    """An HTTP server on a free loopback port, on a daemon thread, that answers each POST with
    ``handle(path, headers, body)``: ``(content type, body)``, or None for an empty 200."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            answer = handle(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            self.send_response(200)
            if answer is not None:
                self.send_header("Content-Type", answer[0])
                self.send_header("Content-Length", str(len(answer[1])))
            self.end_headers()
            if answer is not None:
                self.wfile.write(answer[1])

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class HttpReceiver:
    def __init__(self, signal: str = "traces"):
        self.request_type, self.response_type = SERVICES[signal][:2]
        self.requests, self.headers, self.paths = [], [], []
        self.server = serve_posts(self._export)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _export(self, path, headers, body):
        request = self.request_type()
        request.ParseFromString(body)
        self.requests.append(request)
        self.headers.append(headers)
        self.paths.append(path)
        return "application/x-protobuf", self.response_type().SerializeToString()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
