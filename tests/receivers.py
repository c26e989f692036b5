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


class HttpReceiver:
    def __init__(self):
        self.requests, self.headers, self.paths = [], [], []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.requests.append(request)
                receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                receiver.paths.append(self.path)
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
