"""Sidecar and span throughput, measured in one run.

1. Drain and aggregate: START/END records already in a ring, drained by the sidecar (join by op_id,
   latency, busbw, histograms), in records per second on one core. Goal >= 300k records/s.
2. Span build and encode: commlens' spans (OTLP protobuf built from the records, serialized) against
   the OpenTelemetry SDK's own path (tracer spans, BatchSpanProcessor, the OTLP encoder), in spans
   per second. Goal: commlens >= 2x the SDK.
3. The trace file (the embedded default sink): spans built and written as OTLP JSON lines, built as
   JSON directly against protobuf messages put through ``json_format.MessageToDict``, in spans per
   second.

    python bench/export_throughput.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from opentelemetry.sdk.trace.export import SpanExportResult

from commlens.agent.sidecar import Sidecar
from commlens.exporters.otlp import BatchSpanProcessor
from commlens.hooks import record
from commlens.ring import codec
from commlens.ring.memory import Ring

COLLECTIVES = 50_000
ROUNDS = 5


def drain_rate() -> float:
    ring = Ring(slots=1 << 18)
    group = ring.intern(codec.encode_group("0", "default_pg", [0, 1, 2, 3], 0, "gloo"))
    sig = ring.intern(codec.encode_signature([([1024], "Float")], [([1024], "Float")]))
    rates, op_id, t = [], 0, 0
    for _ in range(ROUNDS):
        sidecar = Sidecar(ring, rank=0, hang_threshold_s=1e9)
        sidecar.reader.cursor = op_id * 2  # start at this round's records
        for _ in range(COLLECTIVES):
            op_id += 1
            t += 1000
            record.start(ring.write, 0, group, op_id, op_id, 4096, sig, -1, t_ns=t)
            record.end(ring.write, 0, group, op_id, op_id, 4096, sig, -1, t_ns=t + 500)
        start = time.perf_counter()
        read = sidecar.drain()
        rates.append(read / (time.perf_counter() - start))
        assert read == 2 * COLLECTIVES and sum(sidecar.stats.completed.values()) == COLLECTIVES
    return statistics.median(rates)


def _collectives() -> list:
    from commlens.exporters.telemetry import Collective

    return [Collective("all_reduce", "0", 4, i, False, i, 0, 4096, "Float", False, "ok", 10**18 + i * 1000,
                       10**18 + i * 1000 + 500, 3.2e9, False, False, False, False) for i in range(COLLECTIVES // 5)]


class _Encode:
    """A span exporter that serializes the request, as a real one would, and keeps only the size."""

    form = "protobuf"

    def __init__(self):
        self.bytes = 0

    def export(self, request, within_s: float) -> SpanExportResult:
        self.bytes += len(request.SerializeToString())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def commlens_span_rate() -> float:
    collectives, rates = _collectives(), []
    for _ in range(ROUNDS):
        exporter = BatchSpanProcessor(_Encode(), {"service.name": "bench"}, job="bench", world_size=4,
                                queue_size=len(collectives), batch_size=512)
        start = time.perf_counter()
        for c in collectives:
            exporter.queue(c)
        exporter.flush(60)
        rates.append(len(collectives) / (time.perf_counter() - start))
        exporter.shutdown(5)
        assert exporter.counts["exported"] == len(collectives)
    return statistics.median(rates)


def file_span_rates() -> tuple[float, float]:
    """Spans/s written to an OTLP JSON lines file: commlens' JSON mapping, and protobuf's in its place."""
    import base64
    import os
    import tempfile

    from google.protobuf.json_format import MessageToDict

    from commlens.exporters import span_exporters

    class ProtobufJsonLines(span_exporters.JsonLinesSpanExporter):
        """The same file sink, each line from protobuf's own JSON mapping of the protobuf request: the baseline."""

        form = "protobuf"

        def export(self, request, within_s: float) -> SpanExportResult:
            data = MessageToDict(request, use_integers_for_enums=True)
            for span in data["resourceSpans"][0]["scopeSpans"][0]["spans"]:
                span["traceId"], span["spanId"] = (base64.b64decode(span[k]).hex() for k in ("traceId", "spanId"))
            with open(self.path, "a") as f:
                f.write(json.dumps(data, separators=(",", ":")) + "\n")
            return SpanExportResult.SUCCESS

    collectives, rates = _collectives(), {"commlens": [], "protobuf": []}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(ROUNDS):
            for name, transport in (("commlens", span_exporters.JsonLinesSpanExporter), ("protobuf", ProtobufJsonLines)):
                path = os.path.join(folder, name)
                exporter = BatchSpanProcessor(transport(path), {"service.name": "bench"}, job="bench",
                                        world_size=4, queue_size=len(collectives))
                start = time.perf_counter()
                for c in collectives:
                    exporter.queue(c)
                exporter.flush(120)
                rates[name].append(len(collectives) / (time.perf_counter() - start))
                exporter.shutdown(5)
                assert exporter.counts["exported"] == len(collectives)
                os.unlink(path)
    return statistics.median(rates["commlens"]), statistics.median(rates["protobuf"])


def sdk_span_rate() -> float:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter as SdkExporter, SpanExportResult

    class Encode(SdkExporter):
        def __init__(self):
            self.spans = 0

        def export(self, spans):
            encode_spans(spans).SerializeToString()
            self.spans += len(spans)
            return SpanExportResult.SUCCESS

    collectives, rates = _collectives(), []
    for _ in range(ROUNDS):
        exporter = Encode()
        provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
        provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=len(collectives),
                                                       max_export_batch_size=512))
        tracer = provider.get_tracer("commlens")
        start = time.perf_counter()
        for c in collectives:
            span = tracer.start_span(c.op, start_time=c.start_ns, attributes={
                "commlens.job": "bench", "commlens.world_size": 4, "commlens.op": c.op, "commlens.op_id": c.op_id,
                "commlens.seq": c.seq, "commlens.pg.name": c.pg, "commlens.pg.size": c.pg_size,
                "commlens.rank": c.rank, "commlens.bytes": c.nbytes, "commlens.dtype": c.dtype,
                "commlens.async": c.async_op, "commlens.status": c.status, "commlens.p2p": c.is_p2p,
                "commlens.busbw_bytes_per_s": c.busbw, "commlens.nan": c.nan, "commlens.hang": c.hang,
                "commlens.slow": c.slow})
            span.end(end_time=c.end_ns)
        provider.force_flush(60_000)
        rates.append(len(collectives) / (time.perf_counter() - start))
        provider.shutdown()
        assert exporter.spans == len(collectives)
    return statistics.median(rates)


def main() -> int:
    drained = drain_rate()
    ours, sdk = commlens_span_rate(), sdk_span_rate()
    to_file, via_protobuf = file_span_rates()
    print(f"drain and aggregate: {drained / 1e3:.0f}k records/s on one core (goal >= 300k)")
    print(f"spans built and encoded: commlens {ours / 1e3:.1f}k/s, OpenTelemetry SDK path {sdk / 1e3:.1f}k/s "
          f"= {ours / sdk:.2f}x (goal >= 2x)")
    print(f"spans written to the trace file: {to_file / 1e3:.1f}k/s, {via_protobuf / 1e3:.1f}k/s with protobuf's "
          f"MessageToDict = {to_file / via_protobuf:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
