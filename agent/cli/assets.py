"""``commlens assets DIR``: the Grafana dashboards, Prometheus rules and Kubernetes manifests that ship
in the package, written out for an operator to load.

    commlens assets ./commlens-assets
    # ./commlens-assets/dashboards/*.json          Grafana: import, or a provisioning folder
    # ./commlens-assets/deploy/prometheus-rules.yaml   Prometheus: rule_files
    # ./commlens-assets/deploy/kubernetes/         kubectl apply -k
    commlens assets --scrape-interval 30s ./assets   # the rules and the PodMonitor for 30 s scrapes
"""

from __future__ import annotations

import pathlib
import re
from importlib.resources import files
from importlib.resources.abc import Traversable

from ..config import ConfigError
from ..verdicts import rule_files

PACKAGES = ("dashboards", "deploy")
"""The folders of the repository that ship as ``commlens.<name>``; their build scripts stay behind."""


def write_assets(folder: pathlib.Path, interval_s: int | None = None) -> list[pathlib.Path]:
    """Copy every shipped asset under ``folder`` (new or empty); returns the files written. With
    ``interval_s``, the alert rules, the PrometheusRule and the PodMonitor are written for Prometheus
    scraping every ``interval_s`` seconds (``rule_files.at_interval``)."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(f"{folder} is not accepted: give a new or empty folder (nothing there is overwritten)")
    written = [path for name in PACKAGES for path in _copy(files(f"commlens.{name}"), folder / name)]
    if interval_s is not None:
        deploy = folder / "deploy"
        source = (deploy / "prometheus-rules.yaml").read_text()
        (deploy / "prometheus-rules.yaml").write_text(rule_files.at_interval(source, interval_s))
        (deploy / "kubernetes" / "prometheusrule.yaml").write_text(rule_files.prometheus_rule(source, interval_s))
        monitor = deploy / "kubernetes" / "podmonitor.yaml"
        monitor.write_text(re.sub(r"interval: \d+[sm]\b", f"interval: {interval_s}s", monitor.read_text()))
    return written


def _copy(source: Traversable, target: pathlib.Path) -> list[pathlib.Path]:
    written = []
    for entry in sorted(source.iterdir(), key=lambda e: e.name):
        if entry.is_dir() and entry.name != "__pycache__":
            written += _copy(entry, target / entry.name)
        elif entry.is_file() and entry.name.endswith((".json", ".yaml")):
            target.mkdir(parents=True, exist_ok=True)
            (target / entry.name).write_bytes(entry.read_bytes())
            written.append(target / entry.name)
    return written
