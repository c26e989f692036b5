"""Builds the files of deploy/ that carry files kept elsewhere in the repository:

* ``prometheus-rules.yaml``: the alert rules of the verdicts' catalogue (``agent/verdicts/rules``, a file
  per kind; ``commlens.agent.verdicts.catalogue``);
* ``kubernetes/prometheusrule.yaml``: the PrometheusRule holding those groups at the scrape interval of
  ``kubernetes/podmonitor.yaml`` (15 s; ``commlens.agent.verdicts.rule_files``);
* ``kubernetes/grafana-dashboards.yaml``: a ConfigMap holding ``dashboards/*.json`` for Grafana's
  dashboard sidecar.

    python deploy/build.py      # tests/test_deploy.py checks the committed files match
"""

from __future__ import annotations

import pathlib
import sys

import yaml

from commlens.agent.verdicts.rule_files import parse_interval, prometheus_rule
from commlens.agent.verdicts.catalogue import rules_text

HERE = pathlib.Path(__file__).resolve().parent
DASHBOARDS = HERE.parent / "dashboards"
LABELS = {"app.kubernetes.io/part-of": "commlens"}


def scrape_interval_s() -> int:
    """The scrape interval of the shipped PodMonitor, in seconds."""
    monitor = yaml.safe_load((HERE / "kubernetes" / "podmonitor.yaml").read_text())
    return parse_interval(monitor["spec"]["podMetricsEndpoints"][0]["interval"])


def prometheus_rule_text() -> str:
    """``prometheus-rules.yaml``'s groups at the PodMonitor's scrape interval (``commlens.agent.verdicts.rule_files``)."""
    return prometheus_rule(rules_text(), scrape_interval_s())


def dashboards_config_map() -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "commlens-grafana-dashboards", "labels": {**LABELS, "grafana_dashboard": "1"}},
            "data": {path.name: path.read_text() for path in sorted(DASHBOARDS.glob("*.json"))}}


def _literal_blocks(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


def render(document: dict, source: str) -> str:
    dumper = type("Dumper", (yaml.SafeDumper,), {})
    dumper.add_representer(str, _literal_blocks)
    header = f"# Built by deploy/build.py from {source}; do not edit: run python deploy/build.py\n"
    return header + yaml.dump(document, Dumper=dumper, sort_keys=False, width=120)


def dashboards_text() -> str:
    return render(dashboards_config_map(), "dashboards/*.json")


OUTPUTS = {"prometheus-rules.yaml": rules_text, "kubernetes/prometheusrule.yaml": prometheus_rule_text,
           "kubernetes/grafana-dashboards.yaml": dashboards_text}
"""Each built file's path in ``deploy/``, and what builds its text."""


def main() -> int:
    for name, build in OUTPUTS.items():
        (HERE / name).write_text(build())
    return 0


if __name__ == "__main__":
    sys.exit(main())
