"""OTLP traces: one span per collective per rank, built from the sidecar's ``Collective`` records on
the processor's own thread, never the training thread. Shaped as OpenTelemetry's SDK is: a
``BatchSpanProcessor`` (queue, thread, batching, sampling, every outcome counted in ``counts``) above
a span exporter (``span_exporters``: gRPC, HTTP/protobuf, or OTLP JSON lines in a file) whose ``export``
sends one batch.
See docs/traces.md.

Example::

    spans = BatchSpanProcessor(HttpSpanExporter("http://collector:4318/v1/traces"), {"service.name": "train"},
                               job="run-7")
    spans.queue(collective)         # from the sidecar thread; never blocks
    spans.shutdown(timeout_s=5)     # sends what is queued within 5 s; the rest is counted failed
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import random
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status
from opentelemetry.sdk.trace.export import SpanExportResult

from . import names
from .span_exporters import SpanExporter
from .telemetry import HAND_OVER_S, Collective

SCOPE = InstrumentationScope(name="commlens", version="0.1.0")
_LOW64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
"""2^64 / the golden ratio, odd: multiplying by it spreads consecutive integers evenly (Fibonacci hashing)."""


def trace_id(job: str, pg: str, seq: int, is_p2p: bool = False) -> bytes:
    """The 16-byte trace id every rank derives for the same collective (``job``: ``trace_scope``'s)."""
    return hashlib.blake2b(f"{job}\0{pg}\0{'p2p' if is_p2p else 'c'}\0{seq}".encode(), digest_size=16).digest()


def trace_scope(job: str, attempt: int) -> str:
    """What a collective's trace id is derived in, beside its group and seq: the job, and after an elastic
    restart its attempt too (whose collectives are numbered from 0 again: no trace joins two attempts)."""
    return job if attempt == 0 else f"{job}\0attempt {attempt}"


def _double(value: float) -> float | str:
    return value if math.isfinite(value) else "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"


_PROTO_VALUE: dict[type, Callable[[Any], dict]] = {
    bool: lambda v: {"bool_value": v}, int: lambda v: {"int_value": v}, float: lambda v: {"double_value": v}}
_JSON_VALUE: dict[type, Callable[[Any], dict]] = {
    bool: lambda v: {"boolValue": v}, int: lambda v: {"intValue": str(v)}, float: lambda v: {"doubleValue": _double(v)}}


def attributes(mapping: Mapping[str, Any], values: dict[type, Callable[[Any], dict]] = _PROTO_VALUE,
               string: str = "string_value") -> list[dict]:
    """OTLP ``KeyValue``s as the dicts protobuf's constructors take (``Span(attributes=...)``): half
    the time of building each message. Any value not a bool, int or float is a string."""
    return [{"key": key, "value": values[type(value)](value) if type(value) in values else {string: str(value)}}
            for key, value in mapping.items()]


def json_attributes(mapping: Mapping[str, Any]) -> list[dict]:
    """The same in OTLP JSON (protobuf's JSON mapping: 64-bit integers as strings)."""
    return attributes(mapping, _JSON_VALUE, "stringValue")


_KINDS_KEPT = 1024
"""Kinds of span (``SpanBuilder``) kept encoded (~1.5 KB each); past that many they are encoded anew."""


class SpanBuilder:
    """Collective -> an OTLP ``Span`` (protobuf, added to a request's spans) or its OTLP JSON text.

    The attributes of a span's kind are encoded once per kind (docs/performance.md); each span adds
    its own (``_own``)."""

    def __init__(self, job: str, world_size: int, attempt: int = 0):
        self.scope = trace_scope(job, attempt)
        self._shared = {names.JOB: job, names.WORLD_SIZE: world_size}
        self._kinds: dict[tuple, tuple[bytes, str]] = {}

    def add_proto(self, spans: Any, c: Collective) -> None:
        """Add ``c``'s span to ``spans``, a request's repeated ``Span`` field (built in place: no copy)."""
        error = _error(c)
        span = spans.add(trace_id=trace_id(self.scope, c.pg, c.seq, c.is_p2p), span_id=_span_id(),
                         start_time_unix_nano=c.start_ns, end_time_unix_nano=c.end_ns,
                         attributes=attributes({**_own(c), **({names.NONFINITE_ENTRY: c.nonfinite_entry}
                                                              if c.nonfinite_entry else {})}),
                         status=None if error is None else {"code": Status.STATUS_CODE_ERROR, "message": error})
        span.MergeFromString(self._kind(c)[0])  # name, kind and the kind's attributes, after the span's own

    def json(self, c: Collective) -> str:
        """The span's OTLP JSON text, as protobuf's JSON mapping writes the span ``add_proto`` adds (ids
        in hex, enums as numbers), built without it."""
        error = _error(c)
        status = "" if error is None else f',"status":{{"message":{json.dumps(error)},"code":{Status.STATUS_CODE_ERROR}}}'
        return (f'{{"traceId":"{trace_id(self.scope, c.pg, c.seq, c.is_p2p).hex()}","spanId":"{_span_id().hex()}",'
                f'"startTimeUnixNano":"{c.start_ns}","endTimeUnixNano":"{c.end_ns}",'
                f'"attributes":[{_numbers_json(_own(c))},{_entry_json(c)}{self._kind(c)[1]}{status}}}')

    def _kind(self, c: Collective) -> tuple[bytes, str]:
        """The kind of ``c``'s span, encoded: (a ``Span`` holding its name, kind and the kind's
        attributes, serialized; the JSON text of the same, from the name to the attributes' end)."""
        key = (c.op, c.pg, c.pg_size, c.rank, c.nbytes, c.dtype, c.async_op, c.status, c.is_p2p, c.nan, c.inf,
               c.hang, c.slow, c.in_flight, c.bucket, c.last_bucket, c.wire_bytes, c.module, c.phase, c.peer)
        found = self._kinds.get(key)
        if found is None:
            if len(self._kinds) >= _KINDS_KEPT:
                self._kinds.clear()
            shared = {**self._shared, names.OP: c.op, names.PG_NAME: c.pg, names.PG_SIZE: c.pg_size,
                      names.RANK: c.rank, names.BYTES: c.nbytes, names.DTYPE: c.dtype,
                      names.ASYNC: c.async_op, names.STATUS: c.status, names.P2P: c.is_p2p,
                      names.NAN: c.nan, names.INF: c.inf, names.HANG: c.hang, names.SLOW: c.slow}
            if c.is_p2p:
                shared[names.PEER] = c.peer
            if c.phase:
                shared[names.MODULE], shared[names.PHASE] = c.module, c.phase
            if c.bucket >= 0:
                shared[names.DDP_BUCKET], shared[names.DDP_IS_LAST] = c.bucket, c.last_bucket
                shared[names.DDP_WIRE_BYTES] = c.wire_bytes
            if c.in_flight:
                shared[names.IN_FLIGHT] = True
            encoded = Span(name=c.op, kind=Span.SPAN_KIND_INTERNAL, attributes=attributes(shared)).SerializeToString()
            text = f'{json.dumps(json_attributes(shared))[1:]},"name":{json.dumps(c.op)},"kind":{Span.SPAN_KIND_INTERNAL}'
            found = self._kinds[key] = (encoded, text)
        return found


def _own(c: Collective) -> dict[str, Any]:
    """The attributes of ``c``'s span that are its own, not its kind's."""
    own = {names.OP_ID: c.op_id, names.SEQ: c.seq, names.BUSBW: c.busbw}
    if c.gpu_start_ns >= 0:
        own[names.GPU_QUEUE_S] = (c.gpu_start_ns - c.start_ns) / 1e9
        own[names.GPU_EXEC_S] = (c.end_ns - c.gpu_start_ns) / 1e9
    if c.in_flight:
        own[names.AGE_S] = (c.end_ns - c.start_ns) / 1e9
    if c.loss_scale_skipped:
        own[names.LOSS_SCALE_SKIPPED] = c.loss_scale_skipped
    if c.send_number:
        own[names.SEND_NUMBER] = c.send_number
    if c.fingerprint >= 0:
        own[names.FINGERPRINT] = c.fingerprint
    if c.scale_jump is not None:
        own[names.INPUT_SCALE_JUMP], own[names.INPUT_SCALE_JUMP_AT_STEP] = c.scale_jump
    return own


def _entry_json(c: Collective) -> str:
    """The OTLP JSON of ``c``'s ``NONFINITE_ENTRY`` attribute and a comma, or "" without one."""
    if not c.nonfinite_entry:
        return ""
    return f'{{"key":"{names.NONFINITE_ENTRY}","value":{{"stringValue":{json.dumps(c.nonfinite_entry)}}}}},'


def _numbers_json(mapping: dict[str, int | float]) -> str:
    """The OTLP JSON of attributes whose values are ints or floats and whose keys need no escaping,
    without the list's brackets: ``json.dumps(json_attributes(mapping))[1:-1]``, 5x faster."""
    return ",".join([f'{{"key":"{key}","value":{{"intValue":"{value}"}}}}' if type(value) is int else
                     f'{{"key":"{key}","value":{{"doubleValue":{value!r}}}}}' if math.isfinite(value) else
                     f'{{"key":"{key}","value":{{"doubleValue":"{_double(value)}"}}}}' for key, value in mapping.items()])


def _error(c: Collective) -> str | None:
    """The status message of ``c``'s span when its status is an error."""
    if c.status not in ("ok", "in_flight") or c.hang or c.nan or c.inf:
        return f"{c.op} seq {c.seq}: {'hung' if c.hang else 'NaN' if c.nan else 'Inf' if c.inf else c.status}"
    return None


def _span_id() -> bytes:
    return random.getrandbits(64).to_bytes(8, "big")


_CHUNK = 8
"""Spans built between two hand-overs of the GIL."""


class BatchSpanProcessor:
    """A bounded queue of collectives and a thread that builds and sends them in batches.

    ``beside_training``: it hands the GIL over between chunks of spans (docs/performance.md, "The
    GIL"). Sampling keys on a hash of group and seq, the same on every rank, below a fixed ratio or
    ``budget_per_s`` (docs/traces.md); anomalies are always kept."""

    def __init__(self, exporter: SpanExporter, resource: Mapping[str, Any], job: str, world_size: int = 1,
                 sampler_ratio: float = 1.0, sample_none: bool = False, queue_size: int = 8192,
                 batch_size: int = 64, budget_per_s: float | None = None,
                 beside_training: bool = False, attempt: int = 0):
        self.exporter, self.builder = exporter, SpanBuilder(job, world_size, attempt)
        self.resource = Resource(attributes=attributes(resource))
        self._json = exporter.form == "json"
        self._json_head = ('{"resourceSpans":[{"resource":{"attributes":' + json.dumps(json_attributes(resource))
                           + '},"scopeSpans":[{"scope":' + json.dumps({"name": SCOPE.name, "version": SCOPE.version})
                           + ',"spans":[')
        self.scope, self.bound = trace_scope(job, attempt), int(sampler_ratio * (1 << 64))
        self.budget_per_s = budget_per_s
        self._window_start, self._offered, self._kept = time.monotonic(), 0, 0
        self._bases: dict[tuple[str, bool], int] = {}
        self.sample_none, self.queue_size, self.batch_size = sample_none, queue_size, batch_size
        self._hand_over_s = HAND_OVER_S if beside_training else 0.0
        """``beside_training``: in the training process, where a long stretch holding the GIL delays training."""
        self.counts: collections.Counter[str] = collections.Counter()
        self._queue: collections.deque = collections.deque()
        self._wake, self._idle, self._stop = threading.Event(), threading.Event(), threading.Event()
        self._idle.set()
        self._deadline = float("inf")  # set by shutdown: no send outlasts it
        self._sending, self._abandoned, self._counting = 0, False, threading.Lock()
        self._thread = threading.Thread(target=self._run, name="commlens-spans", daemon=True)
        self._thread.start()

    def sampled(self, pg: str, seqs: Sequence[int], is_p2p: bool) -> list[int]:
        """Which of the ordinary collectives (completed, in time, finite) ``seqs`` of group ``pg`` are
        kept, by index; the others are counted. The sidecar asks this before it builds any of them
        (``Sidecar(sample=...)``), for all of one drain's collectives of a shape at once."""
        if self.sample_none:
            kept: list[int] = []
        else:
            bound = self.bound if self.budget_per_s is None else self._budget_bound(len(seqs))
            if bound > _LOW64:
                kept = list(range(len(seqs)))
            else:
                base = self._base(pg, is_p2p)
                kept = [k for k, seq in enumerate(seqs) if ((base ^ seq) * _GOLDEN) & _LOW64 < bound]
            if self.budget_per_s is not None:  # the rate jumped within the window: the budget holds
                kept = kept[:max(0, math.ceil(self.budget_per_s - self._kept))]
                self._kept += len(kept)
        if len(kept) < len(seqs):
            self.counts["sampled_out"] += len(seqs) - len(kept)
        return kept

    def _budget_bound(self, offered: int) -> int:
        """The bound for ``offered`` more collectives: each second it follows the last second's rate."""
        now = time.monotonic()
        if now - self._window_start >= 1.0:
            rate = self._offered / (now - self._window_start)
            self.bound = (1 << 64) if rate <= self.budget_per_s else int(self.budget_per_s / rate * (1 << 64))
            self._window_start, self._offered, self._kept = now, 0, 0
        self._offered += offered
        return self.bound

    def _base(self, pg: str, is_p2p: bool) -> int:
        """The group's sampling key, worked out once from its trace id's inputs; a collective's key
        is ``((base ^ seq) * _GOLDEN) mod 2^64``: the same on every rank, ~0.2 µs where a blake2b
        of the trace id takes 0.9, and consecutive seqs spread evenly over the 64 bits."""
        base = self._bases.get((pg, is_p2p))
        if base is None:
            base = self._bases[(pg, is_p2p)] = int.from_bytes(trace_id(self.scope, pg, 0, is_p2p)[8:], "big")
        return base

    def queue(self, c: Collective) -> None:
        """Queue the span of a collective kept (an anomaly, or ``sampled``), or count it dropped when
        the queue is full. Never blocks."""
        if len(self._queue) >= self.queue_size:
            self.counts["dropped"] += 1
        else:
            if self._idle.is_set():
                self._idle.clear()
            self._queue.append(c)
            if len(self._queue) == 1:  # the thread sleeps until there is something to send
                self._wake.set()

    def flush(self, timeout_s: float) -> bool:
        """Send what is queued; True when all of it was handed over within ``timeout_s``."""
        self._wake.set()
        return self._idle.wait(timeout_s)

    def shutdown(self, timeout_s: float) -> None:
        """Send what is queued within ``timeout_s`` whatever the collector does; every span not
        handed over by then is counted ``failed``."""
        self._deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        with self._counting:
            unsent = len(self._queue)  # the sidecar, the only producer, has stopped
            self._queue.clear()
            if self._thread.is_alive():  # a send begun before shutdown may outlast it: written off unconfirmed
                self._abandoned = True
                unsent += self._sending
            if unsent:
                self.counts["failed"] += unsent
        self.exporter.shutdown()

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            if not stopping:
                self._wake.wait()
                self._wake.clear()
            while time.monotonic() < self._deadline:
                with self._counting:
                    if self._abandoned or not self._queue:
                        break
                    batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
                    self._sending = len(batch)
                self._send(batch)
            self._idle.set()
            if stopping:
                return

    def _send(self, batch: list) -> None:
        try:
            collectives = (c for chunk in self._chunks(batch) for c in chunk)  # built between hand-overs
            if self._json:
                request = self.json_request([self.builder.json(c) for c in collectives])
            else:
                request = self.request(collectives)
            sent = self.exporter.export(request, max(0.01, self._deadline - time.monotonic()))
        except Exception:  # a span that cannot be encoded: the batch is lost, and counted
            sent = SpanExportResult.FAILURE
        result = "exported" if sent is SpanExportResult.SUCCESS else "failed"  # a dead or slow collector too
        with self._counting:
            if not self._abandoned:
                self.counts[result] += len(batch)
            self._sending = 0

    def _chunks(self, batch: list) -> Iterator[list]:
        """``batch`` in chunks of ``_CHUNK``, each after a hand-over of the GIL beside training."""
        for at in range(0, len(batch), _CHUNK):
            if self._hand_over_s:
                time.sleep(self._hand_over_s)
            yield batch[at:at + _CHUNK]

    def request(self, collectives: Iterable[Collective] = ()) -> ExportTraceServiceRequest:
        """The export request of the spans of ``collectives`` as protobuf, for the gRPC and HTTP exporters."""
        request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
            resource=self.resource, scope_spans=[ScopeSpans(scope=SCOPE)])])
        spans = request.resource_spans[0].scope_spans[0].spans
        for c in collectives:
            self.builder.add_proto(spans, c)
        return request

    def json_request(self, spans: list[str]) -> str:
        """The same request as OTLP JSON text, of spans as JSON text, for an exporter whose ``form``
        is ``"json"`` (the trace file)."""
        return self._json_head + ",".join(spans) + "]}]}]}"
