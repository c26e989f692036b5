"""What ships in deploy/: the alert rules pass promtool's checks and their own unit tests."""

import pathlib

from monitoring import promtool

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"


def test_the_alert_rules_parse_and_pass_their_promtool_unit_tests():
    check = promtool("check", "rules", "prometheus-rules.yaml", cwd=DEPLOY)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = promtool("test", "rules", "prometheus-rules.test.yaml", cwd=DEPLOY)
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr
