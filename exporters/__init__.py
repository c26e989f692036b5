"""commlens.exporters — where data leaves the process (OTLP, Prometheus, files)."""
