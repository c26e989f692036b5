"""Installing commlens as a newcomer would, where something it needs is missing; and the newcomer's
path from the installed package: a job run, its folder, its report in a browser."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from monitoring import promtool

ROOT = pathlib.Path(__file__).resolve().parent.parent
FROM_THE_WHEEL = pytest.mark.xdist_group("installed-wheel")


def _source(tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of the checkout without what any build or run left in it (pip builds in the tree it is
    given), and without the virtual environments .ci/run keeps there (gigabytes of torch)."""
    return pathlib.Path(shutil.copytree(ROOT, tmp_path / "source", ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.so", "*.egg-info", "__pycache__", ".pytest_cache", "commlens-out")))


def test_every_package_commlens_imports_is_one_it_requires_at_install():
    """A module that commlens' code imports (lazily too) from outside the standard library comes from a
    distribution that its runtime requirements bring (they or theirs): ``pip install commlens`` alone
    runs it. The test extras, which the suite's environment has too, do not count."""
    import ast
    import importlib.metadata as metadata
    import importlib.util

    from packaging.requirements import Requirement

    def needed(dist: str) -> list[str]:
        """What ``dist`` requires here: no extra, and only where its marker holds (this Python, this OS)."""
        return [r.name for r in map(Requirement, metadata.requires(dist) or ())
                if r.marker is None or r.marker.evaluate({"extra": ""})]

    brought, todo = set(), needed("commlens")
    while todo:
        dist = todo.pop()
        if dist not in brought:
            brought.add(dist)
            todo += needed(dist)
    files = {str(f.locate()) for dist in brought for f in metadata.distribution(dist).files or ()}
    imported = set()
    for folder in ("agent", "hooks", "ring", "exporters"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    imported.add(node.module)
    third = {module for module in imported if module.split(".")[0] not in sys.stdlib_module_names
             and module.split(".")[0] not in ("commlens", "sitecustomize")}  # the job's own, chained if it has one
    assert {"torch", "grpc", "prometheus_client", "opentelemetry.sdk.resources"} <= third, third
    unbrought = sorted(module for module in third if importlib.util.find_spec(module).origin not in files)
    assert unbrought == [], f"imported, but no requirement of commlens brings them: {unbrought}"


def test_an_install_without_a_c_compiler_names_what_to_install_in_one_line(tmp_path):
    """pip builds a wheel with the compiler pointed at nothing (about 10 s): the build stops on one
    line that says what is missing and what to install, not on setuptools' traceback."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(_source(tmp_path))],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "CC": str(tmp_path / "cc")})
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    named = [line.strip() for line in output.splitlines() if "commlens: building its C extensions" in line]
    assert len(named) == 1 and "needs a C compiler and Python's headers" in named[0], output
    assert "apt-get install gcc python3-dev" in named[0] and "run pip again" in named[0], output
    assert "Traceback" not in output, output


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    """Where pip installed the wheel it built from the checkout (30-50 s: it compiles the C extensions),
    for the tests of its group (one pytest-xdist worker)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheel"), str(_source(tmp_path))],
                   check=True, capture_output=True, timeout=300)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                    *map(str, (tmp_path / "wheel").glob("commlens-*.whl"))], check=True, capture_output=True, timeout=300)
    return tmp_path / "site"


@FROM_THE_WHEEL
def test_the_installed_package_writes_out_its_dashboards_rules_and_manifests(tmp_path, site):
    """``commlens assets``, run from the installed wheel alone, writes out every dashboard, rule file and
    manifest of the repository as it is, and refuses a folder that is not empty; with ``--scrape-interval
    30s``, rules that promtool accepts and a PodMonitor that scrapes every 30 s."""

    def assets(folder, *options):  # -S: no site-packages, so not the checkout's editable install either
        return subprocess.run([sys.executable, "-S", "-m", "commlens.agent.cli", "assets", *options, str(folder)],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(site)})

    done = assets(tmp_path / "assets")
    assert done.returncode == 0, done.stderr
    shipped = {path.relative_to(ROOT) for pattern in ("dashboards/*.json", "deploy/**/*.yaml") for path in ROOT.glob(pattern)}
    written = {path.relative_to(tmp_path / "assets") for path in (tmp_path / "assets").rglob("*") if path.is_file()}
    assert written == shipped and len(shipped) >= 10, (written, shipped)
    assert all((tmp_path / "assets" / path).read_bytes() == (ROOT / path).read_bytes() for path in shipped)
    assert f"wrote {len(shipped)} files" in done.stdout, done.stdout
    again = assets(tmp_path / "assets")
    assert again.returncode == 2 and "is not accepted: give a new or empty folder" in again.stderr, again.stderr
    done = assets(tmp_path / "at-30s", "--scrape-interval", "30s")
    assert done.returncode == 0, done.stderr
    deploy = tmp_path / "at-30s" / "deploy"
    assert "interval: 30s" in (deploy / "kubernetes" / "podmonitor.yaml").read_text()
    for rules in (deploy / "prometheus-rules.yaml", deploy / "kubernetes" / "prometheusrule.yaml"):
        assert "[10s]" not in rules.read_text() and "[2m]" in rules.read_text()
    checked = promtool("check", "rules", str(deploy / "prometheus-rules.yaml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


@FROM_THE_WHEEL
def test_a_newcomers_job_leaves_one_folder_whose_report_shows_the_fault_in_a_browser(tmp_path, site):
    """From the installed wheel (ahead of the checkout on the path) and an empty folder, a newcomer runs
    an ordinary 2-rank training script with a NaN written into rank 1's parameters at step 5 under
    ``commlens run``, which prints the verdict and writes it, the report and the timeline into the one
    folder it named: headless Chromium opens the report with no console message and shows the verdict
    that names rank 1. No metrics port (0): the suite runs other jobs beside it. About 20 s beside the
    install."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import commlens.agent; print(commlens.agent.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout
    assert where.startswith(str(site)), where  # the installed package, not the checkout's
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    run = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "run", "--job-id", "first-job", "--metrics-port", "0",
                          "--", torchrun, "--nproc-per-node", "2", str(ROOT / "tests" / "faulty_train.py"),
                          "--fault", "nan", "--rank", "1", "--step", "5", "--steps", "12"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    folder = tmp_path / "commlens-out" / "first-job"
    assert [p.name for p in (tmp_path / "commlens-out").iterdir()] == ["first-job"], run.stderr
    assert "commlens run: verdict: NaN/Inf entered on rank 1 in " in run.stderr, run.stderr
    assert run.stderr.endswith(f"the job's files are in {os.path.relpath(folder, tmp_path)} (wrote verdict.txt, "
                               "report.html, timeline.json)\n"), run.stderr
    assert (folder / "verdict.txt").read_text().startswith("NaN/Inf entered on rank 1 in ")
    browser = shutil.which("chromium")
    assert browser, "the newcomer's test needs Debian's chromium (apt-get install chromium)"
    shown = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                            "--dump-dom", (folder / "report.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert not [line for line in shown.stderr.splitlines() if ":CONSOLE" in line], shown.stderr
    assert 'id="verdict">NaN/Inf entered on rank 1 in ' in shown.stdout, shown.stdout[:3000]
