"""Installing commlens as a newcomer would, where something it needs is missing."""

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _source(tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of the checkout without what any build or run left in it (pip builds in the tree it is
    given), and without the virtual environments .ci/run keeps there (gigabytes of torch)."""
    return pathlib.Path(shutil.copytree(ROOT, tmp_path / "source", ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.so", "*.egg-info", "__pycache__", ".pytest_cache", "commlens-out")))


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


def test_the_installed_package_writes_out_its_dashboards_rules_and_manifests(tmp_path):
    """pip builds and installs the wheel (30-50 s: it compiles the C extensions); ``commlens assets``,
    run from that install alone, writes out every dashboard, rule file and manifest of the repository
    as it is, and refuses a folder that is not empty."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheel"), str(_source(tmp_path))],
                   check=True, capture_output=True, timeout=300)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                    *map(str, (tmp_path / "wheel").glob("commlens-*.whl"))], check=True, capture_output=True, timeout=300)

    def assets(folder):  # -S: no site-packages, so not the checkout's editable install either
        return subprocess.run([sys.executable, "-S", "-m", "commlens.agent.cli", "assets", str(folder)],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})

    done = assets(tmp_path / "assets")
    assert done.returncode == 0, done.stderr
    shipped = {path.relative_to(ROOT) for pattern in ("dashboards/*.json", "deploy/**/*.yaml") for path in ROOT.glob(pattern)}
    written = {path.relative_to(tmp_path / "assets") for path in (tmp_path / "assets").rglob("*") if path.is_file()}
    assert written == shipped and len(shipped) >= 10, (written, shipped)
    assert all((tmp_path / "assets" / path).read_bytes() == (ROOT / path).read_bytes() for path in shipped)
    assert f"wrote {len(shipped)} files" in done.stdout, done.stdout
    again = assets(tmp_path / "assets")
    assert again.returncode == 2 and "is not accepted: give a new or empty folder" in again.stderr, again.stderr
