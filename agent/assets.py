"""``commlens assets DIR``: the Grafana dashboards, Prometheus rules and Kubernetes manifests that ship
in the package, written out for an operator to load.

    commlens assets ./commlens-assets
    # ./commlens-assets/dashboards/*.json          Grafana: import, or a provisioning folder
    # ./commlens-assets/deploy/prometheus-rules.yaml   Prometheus: rule_files
    # ./commlens-assets/deploy/kubernetes/         kubectl apply -k
"""

from __future__ import annotations

import pathlib
from importlib.resources import files
from importlib.resources.abc import Traversable

from .config import ConfigError

PACKAGES = ("dashboards", "deploy")
"""The folders of the repository that ship as ``commlens.<name>``; their build scripts stay behind."""


def write_assets(folder: pathlib.Path) -> list[pathlib.Path]:
    """Copy every shipped asset under ``folder`` (new or empty); returns the files written."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(f"{folder} is not accepted: give a new or empty folder (nothing there is overwritten)")
    return [path for name in PACKAGES for path in _copy(files(f"commlens.{name}"), folder / name)]


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
