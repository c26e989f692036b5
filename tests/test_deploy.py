"""What ships in deploy/: the alert rules pass promtool's checks and their own unit tests."""

import pathlib
import shutil
import subprocess

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"


def promtool(*args):
    path = shutil.which("promtool")
    assert path, "promtool is not installed: CI installs Debian's prometheus package (.ci/run)"
    return subprocess.run([path, *args], capture_output=True, text=True, cwd=DEPLOY)


def test_the_alert_rules_parse_and_pass_their_promtool_unit_tests():
    check = promtool("check", "rules", "prometheus-rules.yaml")
    assert check.returncode == 0, check.stdout + check.stderr
    tests = promtool("test", "rules", "prometheus-rules.test.yaml")
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr
