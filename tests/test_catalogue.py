"""The verdicts' catalogue (agent/verdicts/catalogue.py) holds each kind once: what the detectors find is
in it, each kind's alerts are in its own rules file and nowhere else, and the shipped rules are built
from those files in an order where every rule reads records of the same evaluation."""

import ast
import pathlib
import re

import pytest
import yaml

from commlens.agent.verdicts import catalogue, detectors

pytestmark = pytest.mark.torch_free  # no torch code: .ci/run runs it under one torch version

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"


def _rules(part: str) -> list[dict]:
    return yaml.safe_load((catalogue.RULES / f"{part}.yaml").read_text())


def test_the_detectors_find_exactly_the_kinds_of_the_catalogue():
    """Every kind a detector writes is in the catalogue, and every kind of it has a detector."""
    sources = [ast.parse(path.read_text()) for path in pathlib.Path(detectors.__file__).parent.glob("*.py")]
    written = {node.args[0].value for source in sources for node in ast.walk(source) if isinstance(node, ast.Call)
               and getattr(node.func, "id", "") == "Finding" and isinstance(node.args[0], ast.Constant)}
    assert written == set(catalogue.KIND), written ^ set(catalogue.KIND)


def test_each_kind_s_alerts_are_in_its_own_rules_file_and_every_rules_file_belongs_to_the_catalogue():
    for kind in catalogue.KINDS:
        path = catalogue.RULES / f"{kind.name}.yaml"
        if not kind.alerts:  # after the fact only
            assert not path.exists(), path
            continue
        assert [rule["alert"] for rule in _rules(kind.name) if "alert" in rule] == list(kind.alerts), kind
    assert [rule["alert"] for rule in _rules("health")] == list(catalogue.HEALTH)
    for part in catalogue.EVIDENCE:  # records only: an alert belongs to a kind
        assert all("record" in rule for rule in _rules(part)), part
    files = {path.stem for path in catalogue.RULES.glob("*.yaml")}
    assert files == {"recording", "health", *catalogue.EVIDENCE, *(k.name for k in catalogue.KINDS if k.alerts)}


def test_the_shipped_rules_are_the_catalogue_s_and_each_rule_reads_records_already_evaluated():
    """A rule that read a record evaluated after it in its group would see the last evaluation's."""
    assert (DEPLOY / "prometheus-rules.yaml").read_text() == catalogue.rules_text(), \
        "deploy/prometheus-rules.yaml is out of date: run python deploy/build.py"
    groups = yaml.safe_load(catalogue.rules_text())["groups"]
    records = {rule["record"]: group["name"] for group in groups for rule in group["rules"] if "record" in rule}
    alerts = [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]
    assert alerts == [*(alert for kind in catalogue.KINDS for alert in kind.alerts), *catalogue.HEALTH]
    for group in groups:
        evaluated = set()
        for rule in group["rules"]:
            read = set(re.findall(r"commlens:[\w:]+", rule["expr"]))
            assert read <= records.keys(), (rule, read - records.keys())
            later = {name for name in read if records[name] == group["name"] and name not in evaluated}
            assert not later, f"{rule.get('alert') or rule.get('record')} reads {later} before they are evaluated"
            evaluated.add(rule.get("record"))
