"""What ships in deploy/: the alert rules pass promtool's checks and their own unit tests; the
Kubernetes manifests validate against Kubernetes' and the prometheus-operator's schemas and carry
the same rules and dashboards as the files they are built from."""

import copy
import importlib.util
import json
import pathlib
import re

import pytest
import yaml

from commlens.agent.verdicts.rule_files import at_interval, parse_interval
from commlens.exporters import names
from monitoring import promtool

pytestmark = pytest.mark.torch_free  # no torch code: .ci/run runs it under one torch version

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"


def test_the_alert_rules_parse():
    check = promtool("check", "rules", "prometheus-rules.yaml", cwd=DEPLOY)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("cases", ["prometheus-rules.test.yaml", "prometheus-rules.slow.test.yaml"])
def test_the_alert_rules_pass_their_promtool_unit_tests(cases):
    tests = promtool("test", "rules", cases, cwd=DEPLOY)
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr


def test_every_alert_points_at_its_own_section_of_the_runbooks():
    """Each alert's ``runbook_url`` is ``docs/runbooks.md#<its name>``, and that section is there."""
    rules = yaml.safe_load((DEPLOY / "prometheus-rules.yaml").read_text())
    alerts = [rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule]
    runbooks = DEPLOY.parent / "docs" / "runbooks.md"
    sections = {line[3:].strip().lower() for line in runbooks.read_text().splitlines() if line.startswith("## ")}
    assert len(alerts) >= 10
    for alert in alerts:
        assert alert["annotations"]["runbook_url"] == f"docs/runbooks.md#{alert['alert'].lower()}", alert
        assert alert["alert"].lower() in sections, (alert["alert"], sections)


def test_the_long_term_storage_config_is_valid_and_keeps_per_rank_buckets_local():
    check = promtool("check", "config", "prometheus-long-term.yaml", cwd=DEPLOY)
    assert check.returncode == 0, check.stdout + check.stderr
    [remote] = yaml.safe_load((DEPLOY / "prometheus-long-term.yaml").read_text())["remote_write"]
    assert {"source_labels": ["__name__"], "regex": "commlens_collective_duration_seconds_bucket",
            "action": "drop"} in remote["write_relabel_configs"]


def _build():
    spec = importlib.util.spec_from_file_location("deploy_build", DEPLOY / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _documents(folder: str = "kubernetes"):
    """(file name, document) of every manifest in ``deploy/<folder>`` except the kustomization."""
    return [(path.name, document) for path in sorted((DEPLOY / folder).glob("*.yaml"))
            if path.name != "kustomization.yaml" for document in yaml.safe_load_all(path.read_text())]


def test_the_rules_prometheus_rule_and_dashboards_config_map_hold_the_files_they_are_built_from():
    build = _build()
    for name, make in build.OUTPUTS.items():
        assert (DEPLOY / name).read_text() == make(), f"deploy/{name} is out of date: run python deploy/build.py"
    documents = dict(_documents())
    interval = documents["podmonitor.yaml"]["spec"]["podMetricsEndpoints"][0]["interval"]
    rules = yaml.safe_load(at_interval((DEPLOY / "prometheus-rules.yaml").read_text(), parse_interval(interval)))
    assert documents["prometheusrule.yaml"]["spec"]["groups"] == rules["groups"]
    dashboards = documents["grafana-dashboards.yaml"]["data"]
    for path in (DEPLOY.parent / "dashboards").glob("*.json"):
        assert json.loads(dashboards[path.name]) == json.loads(path.read_text())


@pytest.mark.parametrize("folder", ["kubernetes", "kubernetes/gateway"])
def test_the_kustomization_lists_every_manifest(folder):
    kustomization = yaml.safe_load((DEPLOY / folder / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted({name for name, _ in _documents(folder)})


def test_the_manifests_validate_strictly_against_the_kubernetes_and_prometheus_operator_schemas():
    import kubernetes_validate
    from cloudcoil.models.prometheus_operator import v1 as operator

    version = kubernetes_validate.latest_version()
    kinds = set()
    for name, document in _documents() + _documents("kubernetes/gateway"):
        kinds.add(document["kind"])
        model = {"PodMonitor": operator.PodMonitor, "PrometheusRule": operator.PrometheusRule}.get(document["kind"])
        if model is None:
            kubernetes_validate.validate(document, version, strict=True)  # raises, naming the field
        else:  # the operator's CRD schema as pydantic models; an unknown field is dropped, so compare
            parsed = model.model_validate(document).model_dump(by_alias=True, exclude_none=True, mode="json")
            assert parsed == document, name
    assert kinds == {"ConfigMap", "Job", "PodMonitor", "PrometheusRule", "Deployment", "Service"}


def test_the_schema_checks_reject_a_misspelt_field():
    import kubernetes_validate
    from cloudcoil.models.prometheus_operator import v1 as operator

    documents = dict(_documents())
    job = copy.deepcopy(documents["training-job.yaml"])
    job["spec"]["template"]["spec"]["containers"][0]["comand"] = ["train"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)
    monitor = copy.deepcopy(documents["podmonitor.yaml"])
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    parsed = operator.PodMonitor.model_validate(monitor).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert parsed != monitor


def test_the_pod_collectors_send_to_the_gateway_and_every_pipeline_uses_only_components_it_defines():
    pod = yaml.safe_load(dict(_documents())["otel-collector-config.yaml"]["data"]["config.yaml"])
    gateway_documents = _documents("kubernetes/gateway")
    gateway = yaml.safe_load(next(d for _, d in gateway_documents if d["kind"] == "ConfigMap")["data"]["config.yaml"])
    service = next(d for _, d in gateway_documents if d["kind"] == "Service")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "otlp-grpc")
    assert pod["exporters"]["otlp"]["endpoint"] == \
        f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{grpc_port}"
    for config in (pod, gateway):
        assert set(config["service"]["pipelines"]) == {"traces", "metrics"}
        for pipeline in config["service"]["pipelines"].values():
            for kind in ("receivers", "processors", "exporters"):
                assert set(pipeline[kind]) <= set(config[kind]), (kind, pipeline)


def test_the_rules_and_dashboards_query_only_series_commlens_serves():
    """A metric renamed in ``exporters/names.py`` but not in a rule or a panel fails here, not in production."""
    served = names.served()
    files = [DEPLOY / "prometheus-rules.yaml", DEPLOY / "prometheus-long-term.yaml",
             *sorted((DEPLOY.parent / "dashboards").glob("*.json"))]
    texts = {path.name: path.read_text() for path in files}
    queried = {name: set(re.findall(r"\bcommlens_[a-z0-9_]+", text)) for name, text in texts.items()}
    assert all(queried.values()), queried  # each file queries commlens' metrics: the check has something to check
    unknown = {name: found - served for name, found in queried.items() if found - served}
    assert not unknown, f"series no commlens endpoint serves: {unknown}"
