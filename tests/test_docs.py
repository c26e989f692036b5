"""The documentation cannot drift from the code: every variable the code reads is in the
configuration reference with its default, every metric and span attribute commlens writes is in its
reference, and every relative link in the README and docs/ resolves."""

import ast
import pathlib
import re
from typing import Iterator

import pytest

pytestmark = pytest.mark.torch_free  # no torch code: .ci/run runs it under one torch version

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VARIABLE = re.compile(r'"((?:COMMLENS|OTEL|TORCHCOMM|TORCHELASTIC)_[A-Z0-9_]+)"')
ROW = re.compile(r"^\| (.+?) \| (.*?) \|", re.M)
ROW3 = re.compile(r"^\| (.+?) \| (.*?) \| (.*?) \|", re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_variable_the_code_reads_is_in_the_configuration_reference_with_its_default():
    read = {name for folder in ("agent", "hooks", "ring", "exporters") for path in (ROOT / folder).rglob("*.py")
            for name in VARIABLE.findall(path.read_text())}
    defaults = {name: default.strip() for names, default in ROW.findall((ROOT / "docs/configuration.md").read_text())
                for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", names)}
    assert read - set(defaults) == set(), "not in docs/configuration.md"
    assert [name for name in read if not defaults[name]] == [], "without a default in docs/configuration.md"


def _reads(tree: ast.AST, module) -> Iterator[tuple[str, object, tuple | None]]:
    """(variable, default, accepted choices or None) of each ``env.<kind>("NAME", default[, CHOICES])``
    and ``env.get("NAME") or default`` in a module's source."""
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and isinstance(node.values[-1], ast.Constant):
            first = node.values[0]
            if isinstance(first, ast.Call) and getattr(first.func, "attr", "") == "get" and first.args:
                yield ast.literal_eval(first.args[0]), node.values[-1].value, None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "env" and len(node.args) > 1 and isinstance(node.args[0], ast.Constant)):
            choices = getattr(module, node.args[2].id) if len(node.args) > 2 and isinstance(node.args[2], ast.Name) else None
            default = node.args[1]
            yield node.args[0].value, ast.literal_eval(default) if isinstance(default, (ast.Constant, ast.Tuple)) else None, choices


def test_each_default_and_choice_the_configuration_reads_is_the_one_its_reference_gives():
    """Each variable's default (where the reference does not say what "unset" does instead) and each
    accepted choice, as ``agent/config.py`` reads them, are in its row of docs/configuration.md."""
    import importlib

    rows = {name: (default, accepted) for names, default, accepted in ROW3.findall((ROOT / "docs/configuration.md").read_text())
            for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", names)}
    config = ROOT / "agent" / "config.py"
    wrong = []
    for name, default, choices in _reads(ast.parse(config.read_text()), importlib.import_module("commlens.agent.config")):
        documented, accepted = rows[name]
        shown = {bool: lambda v: f"`{str(v).lower()}`", str: lambda v: f"`{v}`", tuple: lambda v: " ".join(f"`{x}`" for x in v)}
        if default not in (None, "") and not documented.startswith("unset"):
            text = shown.get(type(default), str)(default)
            if not all(re.search(rf"(?<![\w.]){re.escape(part)}(?![\w.])", documented) for part in text.split()):
                wrong.append(f"{name}: the code's default {text}, the reference's {documented!r}")
        wrong += [f"{name}: {choice!r} is accepted, not in the reference's {accepted!r}"
                  for choice in choices or () if f"`{choice}`" not in accepted]
    assert wrong == []


def test_every_metric_and_span_attribute_commlens_writes_has_a_row_in_its_reference():
    from commlens.exporters import names

    metrics = {name for name, _ in ROW.findall((ROOT / "docs/metrics.md").read_text())}
    written = [*(f"`{h}`" for h in names.HISTOGRAMS), *(f"`{names.total(c)}`" for c in names.COUNTERS),
               *(f"`{g}`" for g in names.GAUGES)]
    assert [name for name in written if not any(name in row for row in metrics)] == [], "not in docs/metrics.md"
    attributes = " ".join(name for name, _ in ROW.findall((ROOT / "docs/traces.md").read_text()))
    constants = [value for key, value in vars(names).items() if key.isupper() and isinstance(value, str)
                 and value.startswith("commlens.")]
    assert len(constants) >= 20
    assert [name for name in constants if f"`{name}`" not in attributes] == [], "not in docs/traces.md"


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_relative_link_of_the_readme_and_the_docs_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists() or anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


def test_each_packages_public_api_is_the_list_in_docs_api():
    """``__all__`` of each package that has one is what docs/api.md lists under it: a name added or
    removed on one side only fails here (a promise broken, or kept without being made)."""
    import importlib

    text = (ROOT / "docs/api.md").read_text().replace("\n  ", " ")  # each list item on one line
    sections = re.split(r"^## `([\w.]+)`$", text, flags=re.M)[1:]
    listed = {package: {name for item in re.findall(r"^- (.+?): ", body, re.M)
                        for name in re.findall(r"`([A-Za-z_]\w*)", item)}
              for package, body in zip(sections[::2], sections[1::2])}
    packages = {"commlens.ring", "commlens.hooks", "commlens.agent", "commlens.agent.verdicts", "commlens.agent.cli", "commlens.exporters"}
    public = {package: set(getattr(importlib.import_module(package), "__all__", ())) for package in packages}
    assert {package for package, names in public.items() if names} == set(listed), "packages with an __all__"
    for package, names in listed.items():
        assert names == public[package], (package, names ^ public[package])


def test_the_figures_page_is_what_the_bench_results_say_and_no_other_page_judges_a_goal():
    """docs/figures.md is bench/run_all.py's rendering of bench/results/ (a figure edited by hand, or one no
    bench measured, fails here); every other page points there instead of saying a goal is met."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import run_all

    assert (ROOT / "docs" / "figures.md").read_text() == run_all.render(), "run python bench/run_all.py --render"
    for bench in run_all.BENCHES:  # each result says what ran it, where and when
        if not (run_all.RESULTS / f"{bench.name}.txt").exists():
            continue  # figures.md says it has none
        meta, output = run_all.read_result(bench.name)
        assert meta["command"] == f"python {' '.join(bench.argv)}" and output.strip(), bench.name
        assert set(meta) == {"command", "date", "commit", "machine", "seconds"}, meta
    for page in DOCS:  # gpu.md: measured on a device (bench/gpu_checks.sh), which run_all cannot run here
        if page.name not in ("figures.md", "gpu.md"):
            judged = re.findall(r"[^.|]*\b(?:met|missed)\b[^.|]*", page.read_text())
            assert not judged, (page.name, judged)
