"""OTLP metrics: the series of the Prometheus endpoint, pushed over OTLP (gRPC or HTTP/protobuf).

``MetricsPusher`` reads a collector's families every ``interval_s`` on its own thread and hands them
to ``OTLPMetricExporter``; results are counted in ``counts``, never raised. Details: docs/metrics.md.

Example::

    pusher = MetricsPusher(collector.families, OTLPMetricExporter(endpoint), {"service.name": "commlens"})
    pusher.start(interval_s=60)
    ...
    pusher.shutdown(timeout_s=5)      # one last export
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from opentelemetry.sdk.metrics.export import (AggregationTemporality, Gauge, Histogram, HistogramDataPoint, Metric,
                                              MetricExportResult, MetricsData, NumberDataPoint, ResourceMetrics,
                                              ScopeMetrics, Sum)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

SCOPE = InstrumentationScope("commlens")


class MetricsPusher:
    def __init__(self, families: Callable[[], Iterable[Any]], exporter: Any, resource: Mapping[str, Any],
                 delta: bool = False, timeout_s: float = 10.0):
        self.families, self.exporter, self.delta, self.timeout_s = families, exporter, delta, timeout_s
        self.resource = Resource.create(dict(resource))
        self.temporality = AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
        self.counts: collections.Counter[str] = collections.Counter()
        self._start_ns = self._last_ns = time.time_ns()
        self._previous: dict[tuple, Any] = {}
        """(name, attributes) -> the cumulative value at the last export (delta temporality)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._exporting = threading.Lock()
        """One export at a time: the thread's, a caller's, the last one at shutdown (delta keeps state)."""

    def start(self, interval_s: float) -> None:
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="commlens-otlp-metrics",
                                        daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float) -> None:
        """Stop the thread, export once more, and close the exporter; within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.export(max(0.1, deadline - time.monotonic()))
        self.exporter.shutdown(timeout_millis=max(100.0, (deadline - time.monotonic()) * 1000))

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.export(self.timeout_s)

    def export(self, timeout_s: float) -> bool:
        """Build and send one export now; True if the receiver took it."""
        with self._exporting:
            try:
                result = self.exporter.export(self.build(time.time_ns()), timeout_millis=timeout_s * 1000)
            except Exception:  # noqa: BLE001 — telemetry never fails the job: counted
                result = MetricExportResult.FAILURE
            ok = result == MetricExportResult.SUCCESS
            self.counts["exported" if ok else "failed"] += 1
        return ok

    def build(self, now_ns: int) -> MetricsData:
        """The families as OpenTelemetry metric data at ``now_ns``."""
        start_ns = self._last_ns if self.delta else self._start_ns
        metrics = []
        for family in self.families():
            if family.type == "counter":
                data = Sum([NumberDataPoint(attrs, start_ns, now_ns, self._change((family.name, key), value))
                            for key, attrs, value in _values(family, "_total")], self.temporality, is_monotonic=True)
            elif family.type == "gauge":
                data = Gauge([NumberDataPoint(attrs, start_ns, now_ns, value)
                              for _, attrs, value in _values(family, "")])
            elif family.type == "histogram":
                data = Histogram([self._histogram(family.name, key, attrs, buckets, start_ns, now_ns)
                                  for key, (attrs, buckets) in _histograms(family).items()], self.temporality)
            else:
                continue
            if data.data_points:  # an empty family (no hang now) is no metric
                metrics.append(Metric(family.name, family.documentation, None, data))
        self._last_ns = now_ns
        return MetricsData([ResourceMetrics(self.resource, [ScopeMetrics(SCOPE, metrics, "")], "")])

    def _histogram(self, name: str, key: tuple, attrs: dict, buckets: dict, start_ns: int,
                   now_ns: int) -> HistogramDataPoint:
        bounds = sorted(bound for bound in buckets["le"] if not math.isinf(bound))
        cumulative = [buckets["le"][bound] for bound in bounds] + [buckets["le"][math.inf]]
        counts = [int(c - b) for c, b in zip(cumulative, [0, *cumulative[:-1]])]
        counts, total, count = self._change((name, key), (counts, buckets["sum"], int(buckets["count"])))
        return HistogramDataPoint(attrs, start_ns, now_ns, count, total, counts, bounds, None, None)

    def _change(self, key: tuple, value: Any) -> Any:
        """``value`` itself (cumulative), or its change since the last export (delta)."""
        if not self.delta:
            return value
        before, self._previous[key] = self._previous.get(key), value
        if before is None:
            return value
        if isinstance(value, tuple):
            counts, total, count = value
            if count < before[2]:  # the source restarted
                return value
            return [a - b for a, b in zip(counts, before[0])], total - before[1], count - before[2]
        return value if value < before else value - before


def _values(family: Any, suffix: str) -> Iterable[tuple[tuple, dict, float]]:
    for sample in family.samples:
        if sample.name == family.name + suffix:
            yield tuple(sorted(sample.labels.items())), dict(sample.labels), sample.value


def _histograms(family: Any) -> dict[tuple, tuple[dict, dict]]:
    """Labels (less ``le``) -> (attributes, {"le": {bound: cumulative count}, "sum": s, "count": n})."""
    found: dict[tuple, tuple[dict, dict]] = {}
    for sample in family.samples:
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        key = tuple(sorted(labels.items()))
        buckets = found.setdefault(key, (labels, {"le": {}, "sum": 0.0, "count": 0}))[1]
        if sample.name == family.name + "_bucket":
            buckets["le"][float(sample.labels["le"])] = sample.value
        elif sample.name == family.name + "_sum":
            buckets["sum"] = sample.value
        elif sample.name == family.name + "_count":
            buckets["count"] = sample.value
    return found
