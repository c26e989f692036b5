"""The Grafana dashboards: built by dashboards/build.py, valid against Grafana's schema types (the
foundation SDK's models), every query parsed by promtool, and every panel showing data from a real
Prometheus that scraped a demo run with a NaN and a hang injected."""

import enum
import importlib.util
import json
import pathlib
import re
import types
import typing

import pytest
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from monitoring import Demo, Prometheus, promtool, wait_for

FOLDER = pathlib.Path(__file__).resolve().parent.parent / "dashboards"
RULES = FOLDER.parent / "deploy" / "prometheus-rules.yaml"
spec = importlib.util.spec_from_file_location("build", FOLDER / "build.py")
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
NAMES = sorted(build.DASHBOARDS)


def _load(name):
    return json.loads((FOLDER / name).read_text())


def _targets(name):
    """(panel title, expr) of every query of every panel."""
    return [(panel["title"], target["expr"]) for panel in _load(name)["panels"] for target in panel.get("targets", ())]


@pytest.mark.parametrize("name", NAMES)
def test_the_committed_json_is_what_the_generator_builds(name):
    assert (FOLDER / name).read_text() == build.render(build.DASHBOARDS[name]), \
        "dashboards/ is out of date: run python dashboards/build.py"


def _without_empty(value):
    if isinstance(value, dict):
        return {k: _without_empty(v) for k, v in value.items() if v != {}}
    if isinstance(value, list):
        return [_without_empty(v) for v in value]
    return value


def _type_errors(value, hint, path):
    """Where ``value`` (decoded by the SDK) does not have the type its schema model declares."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (typing.Any, object) or value is None:
        return []
    if origin in (typing.Union, types.UnionType):
        found = [_type_errors(value, arg, path) for arg in args]
        return [] if any(not errors for errors in found) else min(found, key=len)
    if origin is typing.Literal:
        return [] if value in args else [f"{path}: {value!r} is not one of {args}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: {value!r} is not a list"]
        return [e for i, item in enumerate(value) for e in _type_errors(item, args[0], f"{path}[{i}]")]
    if origin is dict:
        return [] if isinstance(value, dict) else [f"{path}: {value!r} is not an object"]
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return [] if ok else [f"{path}: {value!r} is not a number"]
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return [] if ok else [f"{path}: {value!r} is not an integer"]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return [] if value in {m.value for m in hint} else [f"{path}: {value!r} is not one of {hint.__name__}"]
    if isinstance(hint, type) and hint.__module__.startswith("grafana_foundation_sdk."):
        if not isinstance(value, hint):
            return [f"{path}: {value!r} is not a {hint.__name__}"]
        hints = typing.get_type_hints(type(value).__init__)
        return [e for field, field_hint in hints.items() if field != "return"
                for e in _type_errors(getattr(value, field, None), field_hint, f"{path}.{field}")]
    if isinstance(hint, type):
        return [] if isinstance(value, hint) else [f"{path}: {value!r} is not a {hint.__name__}"]
    return []


@pytest.mark.parametrize("name", NAMES)
def test_each_dashboard_is_valid_against_grafanas_schema_types(name):
    plugins.register_default_plugins()
    data = _load(name)
    model = Dashboard.from_json(data)
    assert model.schema_version >= 41 and model.panels
    # every field is one the schema knows (the SDK drops the others), with the declared type
    assert _without_empty(json.loads(json.dumps(model, cls=JSONEncoder))) == _without_empty(data)
    assert _type_errors(model, Dashboard, "dashboard") == []
    variables = {v["name"]: v["type"] for v in data["templating"]["list"]}
    assert variables == {"datasource": "datasource", "job": "query", "pg": "query", "rank": "query"}


def test_the_schema_check_finds_unknown_fields_and_wrong_types():
    plugins.register_default_plugins()
    data = _load(NAMES[0])
    data["panels"][1]["targets"][0]["expresion"] = "typo"
    assert _without_empty(json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder))) != _without_empty(data)
    data = _load(NAMES[0])
    data["panels"][1]["gridPos"]["h"] = "8"
    assert _type_errors(Dashboard.from_json(data), Dashboard, "dashboard")


def _concrete(expr, rank=".+"):
    """``expr`` as Grafana sends it: variables and intervals filled in."""
    for variable, value in (("$__rate_interval", "1m"), ("$__range", "5m"), ("$job", ".+"), ("$pg", ".+"),
                            ("$rank", rank)):
        expr = expr.replace(variable, value)
    assert "$" not in expr, expr
    return expr


def test_every_panel_query_parses(tmp_path):
    rules = {"groups": [{"name": "panels", "rules": [
        {"record": f"panel_{i}", "expr": _concrete(expr)}
        for i, expr in enumerate(e for name in NAMES for _, e in _targets(name))]}]}
    (tmp_path / "panels.yaml").write_text(json.dumps(rules))
    check = promtool("check", "rules", str(tmp_path / "panels.yaml"))
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.long
def test_every_panel_shows_data_from_a_demo_with_a_nan_and_a_hang(tmp_path):
    world = 3
    inject = ["nan:rank=1:step=7", "hang:rank=2:step=3"]
    with Demo(tmp_path, world, steps=8, inject=inject) as demo, Prometheus(tmp_path, demo, [RULES]) as prometheus:
        demo.wait_serving()
        # every rank's final metrics, in the rules' own terms: a NaN and a hang were counted
        wait_for(lambda: prometheus.by_rank('sum by (rank) (commlens_collectives_total)') and
                 len(prometheus.by_rank("commlens_info")) == world and
                 prometheus.query("sum(commlens_nan_events_total) > 0 and sum(commlens_hangs_total) > 0") and
                 prometheus.query('ALERTS{alertname="CommlensNaNOrigin", alertstate="firing"}'),
                 "the NaN and the hang in Prometheus, and the NaN's origin named")
        empty = []
        for name in NAMES:
            rank = "1" if "rank" in name else ".+"  # the drill-down shows one rank: the one with the NaN
            for title, expr in _targets(name):
                series = prometheus.query(_concrete(expr, rank))
                if not any(re.fullmatch(r"-?[0-9.e+]+", s["value"][1]) for s in series):
                    empty.append((name, title, expr))
        assert not empty, empty
        # latency panels link to traces: the histograms' exemplars name traces the ranks exported
        exemplars = prometheus.exemplars('commlens_collective_duration_seconds_bucket{op="all_reduce"}')
    traces = {span["traceId"] for rank in range(world)
              for line in (demo.out / f"traces-rank{rank}.jsonl").read_text().splitlines()
              for spans in json.loads(line)["resourceSpans"] for scope in spans["scopeSpans"] for span in scope["spans"]}
    linked = {e["labels"]["trace_id"] for e in exemplars}
    assert linked and linked <= traces, (linked - traces, len(traces))
