"""Installing commlens as a newcomer would, where something it needs is missing."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_an_install_without_a_c_compiler_names_what_to_install_in_one_line(tmp_path):
    """pip builds a wheel with the compiler pointed at nothing (about 10 s): the build stops on one
    line that says what is missing and what to install, not on setuptools' traceback."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "CC": str(tmp_path / "cc")})
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    named = [line.strip() for line in output.splitlines() if "commlens: building its C extensions" in line]
    assert len(named) == 1 and "needs a C compiler and Python's headers" in named[0], output
    assert "apt-get install gcc python3-dev" in named[0] and "run pip again" in named[0], output
    assert "Traceback" not in output, output
