"""All of commlens' configuration, read from the environment in one place and checked at start-up.

OpenTelemetry's variables where one exists, ``COMMLENS_*`` for the rest. A bad value raises
``ConfigError`` naming the variable, the value and what is accepted — at start-up, never later.

Example::

    config = Config.from_env()          # os.environ
    config.metrics_port                 # COMMLENS_METRICS_PORT + LOCAL_RANK
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from typing import Mapping

from commlens.ring.dumps import ATTEMPT_ENV

from .stats import DETAILS

PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio")
DEFAULT_METRICS_PORT = 9464
NAN_CHECKS = ("report", "raise", "off")
METRICS_EXPORTERS = ("prometheus", "otlp", "none")
TEMPORALITIES = ("cumulative", "delta", "lowmemory")


class ConfigError(ValueError):
    """A configuration value commlens cannot use; the message says which, and what would do."""


@dataclasses.dataclass(frozen=True)
class Config:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    job: str = "local"
    attempt: int = 0
    """The job's elastic restarts before this run of the rank (torchrun's ``TORCHELASTIC_RESTART_COUNT``):
    a restarted attempt numbers its collectives from 0 again, and writes its files in its own folder
    (``commlens.ring.dumps.attempt_path``)."""
    drain_interval_s: float = 0.5
    """The longest between two drains: the sidecar, in-process or the pod's, drains sooner when a rank has
    filled a quarter of its ring (``commlens.ring.wakeups``)."""
    hang_threshold_s: float = 300.0
    slow_factor: float = 5.0
    metrics_addr: str = "0.0.0.0"
    metrics_port: int | None = DEFAULT_METRICS_PORT
    """None: metrics are not served."""
    otlp_protocol: str = "http/protobuf"
    otlp_endpoint: str | None = None
    """None: spans go to ``trace_file`` (the embedded default)."""
    otlp_headers: tuple[tuple[str, str], ...] = ()
    service_name: str | None = None
    """``OTEL_SERVICE_NAME``; it wins over a ``service.name`` in the resource attributes."""
    resource_attributes: tuple[tuple[str, str], ...] = ()
    otlp_timeout_s: float = 10.0
    otlp_insecure: bool = False
    otlp_certificate: str | None = None
    trace_file: str = "commlens-traces-{rank}.jsonl"
    sampler: str = "parentbased_always_on"
    sampler_ratio: float = 1.0
    span_budget_per_s: float | None = 100.0
    """Spans a second per rank at the default sampler; None: no budget (a sampler was chosen, or 0)."""
    span_queue: int = 8192
    module_attribution: bool = False
    snapshot_timeout_s: float = 10.0
    metrics_detail: str = "group"
    """What per-collective series are split by (``stats.DETAILS``): group, op, or full."""
    nan_check: str = "report"
    """``NanCheckHook``'s mode on the inputs of every collective, or "off"."""
    nan_check_every: int = 1
    """DDP's gradient buckets are checked on one step in this many (``NanCheckHook``'s ``every``)."""
    fingerprint_every: int = 61
    """N: a group's collectives whose sequence number is a multiple of N have their result fingerprinted
    where they are an all_reduce, broadcast or all_gather (0: none; ``hooks/fingerprints.py``). A prime, so
    that a repeating pattern of ops meets each of its ops at some multiple."""
    prometheus: bool = True
    """Serve the Prometheus endpoint (``OTEL_METRICS_EXPORTER`` lists ``prometheus``, the default)."""
    otlp_metrics_endpoint: str | None = None
    """Push the same metrics over OTLP here (``OTEL_METRICS_EXPORTER`` lists ``otlp``); None: no push."""
    otlp_metrics_protocol: str = "http/protobuf"
    metrics_interval_s: float = 60.0
    metrics_delta: bool = False
    """Delta temporality for OTLP sums and histograms (``..._TEMPORALITY_PREFERENCE`` delta or lowmemory)."""
    ring_slots: int = 65536
    ring_path: str | None = None
    """The file this rank's ring is mapped from (``{rank}`` replaced); None: private memory."""
    ring_dir: str | None = None
    """Where a pod sidecar (``commlens sidecar``) reads the ranks' rings; None: this process exports."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        env = _Env(os.environ if environ is None else environ)
        rank = env.integer("RANK", 0, minimum=0)
        local_rank = env.integer("LOCAL_RANK", 0, minimum=0)
        port_base = env.integer("COMMLENS_METRICS_PORT", DEFAULT_METRICS_PORT, minimum=0, maximum=65535)
        port = None if port_base == 0 else port_base + local_rank
        if port is not None and port > 65535:
            raise ConfigError(f"COMMLENS_METRICS_PORT={port_base} is not accepted with LOCAL_RANK={local_rank}: "
                              f"the rank's port {port} is above 65535; use a base port of at most {65535 - local_rank}")
        protocol = env.choice("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", None, PROTOCOLS) or \
            env.choice("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf", PROTOCOLS)
        endpoint = _endpoint(env, protocol)
        metrics_protocol = env.choice("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", None, PROTOCOLS) or \
            env.choice("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf", PROTOCOLS)
        exporters = env.names("OTEL_METRICS_EXPORTER", ("prometheus",), METRICS_EXPORTERS)
        metrics_endpoint = _endpoint(env, metrics_protocol, "metrics")  # checked even when not used
        if "otlp" not in exporters:
            metrics_endpoint = None
        elif metrics_endpoint is None:  # OpenTelemetry's default
            metrics_endpoint = "http://localhost:4317" if metrics_protocol == "grpc" else "http://localhost:4318/v1/metrics"
        sampler = env.choice("OTEL_TRACES_SAMPLER", "parentbased_always_on", SAMPLERS)
        budget = env.number("COMMLENS_SPAN_BUDGET", 100, minimum=0)
        if budget == 0 or env.get("OTEL_TRACES_SAMPLER") is not None:  # a sampler chosen: it decides
            budget = None
        ratio = env.number("OTEL_TRACES_SAMPLER_ARG", 1.0, minimum=0.0, maximum=1.0) \
            if sampler.endswith("traceidratio") else 1.0
        headers = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS") or ""
        return cls(
            rank=rank, local_rank=local_rank, world_size=env.integer("WORLD_SIZE", 1, minimum=1),
            job=env.get("COMMLENS_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "local",
            attempt=env.integer(ATTEMPT_ENV, 0, minimum=0),
            drain_interval_s=env.number("COMMLENS_DRAIN_INTERVAL_MS", 500, minimum=1, maximum=1000) / 1000,
            hang_threshold_s=env.number("COMMLENS_HANG_THRESHOLD_S", 300, minimum=0.1),
            slow_factor=env.number("COMMLENS_SLOW_FACTOR", 5, minimum=1),
            metrics_addr=env.get("COMMLENS_METRICS_ADDR") or "0.0.0.0",
            metrics_port=port if "prometheus" in exporters else None,
            otlp_protocol=protocol, otlp_endpoint=endpoint,
            otlp_headers=_pairs("OTEL_EXPORTER_OTLP_HEADERS", headers, lower_keys=True),
            service_name=env.get("OTEL_SERVICE_NAME"),
            resource_attributes=_pairs("OTEL_RESOURCE_ATTRIBUTES", env.get("OTEL_RESOURCE_ATTRIBUTES") or ""),
            otlp_timeout_s=(env.number("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", None, minimum=1)
                            or env.number("OTEL_EXPORTER_OTLP_TIMEOUT", 10000, minimum=1)) / 1000,
            otlp_insecure=env.boolean("OTEL_EXPORTER_OTLP_TRACES_INSECURE",
                                      env.boolean("OTEL_EXPORTER_OTLP_INSECURE", False)),
            otlp_certificate=env.get("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE") or
            env.get("OTEL_EXPORTER_OTLP_CERTIFICATE") or None,
            trace_file=env.get("COMMLENS_TRACE_FILE") or "commlens-traces-{rank}.jsonl",
            sampler=sampler, sampler_ratio=ratio, span_budget_per_s=budget,
            span_queue=env.integer("COMMLENS_SPAN_QUEUE", 8192, minimum=1),
            module_attribution=env.boolean("COMMLENS_MODULE_ATTRIBUTION", False),
            snapshot_timeout_s=env.number("COMMLENS_SNAPSHOT_TIMEOUT_S", 10, minimum=0.1),
            nan_check=env.choice("COMMLENS_NAN_CHECK", "report", NAN_CHECKS),
            nan_check_every=env.integer("COMMLENS_NAN_CHECK_EVERY", 1, minimum=1),
            fingerprint_every=env.integer("COMMLENS_FINGERPRINT_EVERY", 61, minimum=0),
            metrics_detail=env.choice("COMMLENS_METRICS_DETAIL", "group", DETAILS),
            prometheus="prometheus" in exporters, otlp_metrics_endpoint=metrics_endpoint,
            otlp_metrics_protocol=metrics_protocol,
            metrics_interval_s=env.number("OTEL_METRIC_EXPORT_INTERVAL", 60000, minimum=1) / 1000,
            metrics_delta=env.choice("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "cumulative",
                                     TEMPORALITIES) != "cumulative",
            ring_slots=env.power_of_two("COMMLENS_RING_SLOTS", 65536),
            ring_dir=env.folder("COMMLENS_RING_DIR"),
            ring_path=env.ring_path("COMMLENS_RING_PATH", rank),
        )


class _Env:
    def __init__(self, environ: Mapping[str, str]):
        self.environ = environ

    def get(self, name: str) -> str | None:
        return self.environ.get(name, "").strip() or None

    def number(self, name: str, default: float | None, minimum: float | None = None,
               maximum: float | None = None, kind: type = float) -> float | None:
        raw = self.get(name)
        if raw is None:
            return default
        accepted = f"{'an integer' if kind is int else 'a number'}" + \
            (f" >= {minimum:g}" if minimum is not None else "") + (f" and <= {maximum:g}" if maximum is not None else "")
        try:
            value = kind(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not accepted: it must be {accepted}") from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise ConfigError(f"{name}={raw!r} is not accepted: it must be {accepted}")
        return value

    def integer(self, name: str, default: int, minimum: int | None = None, maximum: int | None = None) -> int:
        return self.number(name, default, minimum, maximum, kind=int)

    def power_of_two(self, name: str, default: int) -> int:
        value = self.integer(name, default, minimum=2)
        if value & (value - 1):
            raise ConfigError(f"{name}={self.get(name)!r} is not accepted: it must be a power of two >= 2")
        return value

    def folder(self, name: str) -> str | None:
        """An existing folder this process can write in, or None when unset."""
        raw = self.get(name)
        if raw is not None and not (os.path.isdir(raw) and os.access(raw, os.W_OK | os.X_OK)):
            raise ConfigError(f"{name}={raw!r} is not accepted: it must be an existing folder this process can "
                              "write in (a volume shared with the pod sidecar, e.g. an emptyDir with medium Memory)")
        return raw

    def names(self, name: str, default: tuple[str, ...], accepted: tuple[str, ...]) -> tuple[str, ...]:
        """A comma-separated list of names from ``accepted``."""
        raw = self.get(name)
        if raw is None:
            return default
        names = tuple(part.strip() for part in raw.split(",") if part.strip())
        if not names or any(part not in accepted for part in names):
            raise ConfigError(f"{name}={raw!r} is not accepted: use a comma-separated list of {', '.join(accepted)}")
        return names

    def ring_path(self, name: str, rank: int) -> str | None:
        """A file to create in an existing, writable folder (``{rank}`` replaced), or None when unset."""
        raw = self.get(name)
        if not raw:
            return None
        try:
            path = raw.format(rank=rank)
        except (KeyError, IndexError, ValueError):
            path = None
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path is None or os.path.isdir(path) or not (os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)):
            raise ConfigError(f"{name}={raw!r} is not accepted: give a file path in an existing folder this process "
                              "can write in, e.g. /dev/shm/commlens-{rank}.ring ({rank} is replaced)")
        return path

    def choice(self, name: str, default: str | None, accepted: tuple[str, ...]) -> str | None:
        raw = self.get(name)
        if raw is None:
            return default
        if raw.lower() not in accepted:
            raise ConfigError(f"{name}={raw!r} is not accepted: use one of {', '.join(accepted)}")
        return raw.lower()

    def boolean(self, name: str, default: bool) -> bool:
        raw = self.get(name)
        if raw is None:
            return default
        if raw.lower() not in ("true", "false"):
            raise ConfigError(f"{name}={raw!r} is not accepted: use true or false")
        return raw.lower() == "true"


def _endpoint(env: _Env, protocol: str, signal: str = "traces") -> str | None:
    """The endpoint of ``signal`` (traces, metrics), as a full URL; None when neither variable is set."""
    variable = f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
    specific, general = env.get(variable), env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    name, raw = (variable, specific) if specific else ("OTEL_EXPORTER_OTLP_ENDPOINT", general)
    if raw is None:
        return None
    url = urllib.parse.urlsplit(raw)
    try:
        port = url.port
    except ValueError:
        port = -1
    if url.scheme not in ("http", "https") or not url.hostname or port == -1:
        raise ConfigError(f"{name}={raw!r} is not accepted: give a URL such as http://collector:4318 "
                          "(scheme http or https, a host, and an optional numeric port)")
    if protocol == "http/protobuf" and not specific:  # the general endpoint gets the signal's path
        return raw.rstrip("/") + f"/v1/{signal}"
    return raw


def _pairs(name: str, raw: str, lower_keys: bool = False) -> tuple[tuple[str, str], ...]:
    """``key1=value1,key2=value2`` with percent-encoded parts, as OpenTelemetry writes headers and attributes."""
    pairs = []
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{name}={raw!r} is not accepted: use key1=value1,key2=value2")
        key = urllib.parse.unquote(key.strip())
        pairs.append((key.lower() if lower_keys else key, urllib.parse.unquote(value.strip())))
    return tuple(pairs)
