"""Real OTLP trace receivers on loopback, built from opentelemetry-proto: gRPC (grpcio) and HTTP/protobuf."""

from __future__ import annotations

import http.server
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


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


class GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.requests, self.headers = [], []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server.start()

    def Export(self, request, context):  # noqa: N802 (the service's method name)
        self.requests.append(request)
        self.headers.append(dict(context.invocation_metadata()))
        return trace_service_pb2.ExportTraceServiceResponse()

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
    def __init__(self):
        self.requests, self.headers, self.paths = [], [], []
        self.server = serve_posts(self._export)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _export(self, path, headers, body):
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.requests.append(request)
        self.headers.append(headers)
        self.paths.append(path)
        return "application/x-protobuf", trace_service_pb2.ExportTraceServiceResponse().SerializeToString()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
