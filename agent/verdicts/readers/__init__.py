"""The readers: ranks' facts (``facts.RankFacts``) from their metrics endpoints (``endpoints``), from
Prometheus (``prometheus``), or from a job's trace files and flight-recorder dumps (``files``); the
metrics' meaning is read in one place (``metrics``) for the first two.

Example::

    facts = from_endpoints(["http://node1:9464/metrics", "http://node1:9465/metrics"])
    jobs = from_prometheus("http://prometheus:9090")     # job -> its ranks' facts
    facts = from_files("./commlens-out/job-7")
"""

from .common import NO_TELEMETRY, NO_TELEMETRY_EXIT, kept_and_said, say_skipped
from .endpoints import from_endpoints, from_metrics_texts
from .files import NOT_STARTED, attempts_in, clock_offsets, from_files, load_dump, spans_in
from .prometheus import QUERY_TIMEOUT_S, from_prometheus, scrape_interval_s

__all__ = ["NOT_STARTED", "NO_TELEMETRY", "NO_TELEMETRY_EXIT", "QUERY_TIMEOUT_S", "attempts_in", "clock_offsets", "from_endpoints",
           "from_files", "from_metrics_texts", "from_prometheus", "kept_and_said", "load_dump", "say_skipped",
           "scrape_interval_s", "spans_in"]
