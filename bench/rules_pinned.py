"""Which thresholds and ``for`` durations of the alert rules a promtool case pins: each number of a rule's
expression (a threshold, a ratio, a count) is halved and doubled, each ``for`` halved and doubled, one at
a time, and promtool's cases (``deploy/prometheus-rules*.test.yaml``) run on the changed rules. A change
that no case notices survives: nothing tests that number. Goal: none survives.

    python bench/rules_pinned.py [--jobs 4]

About 100 changes of 20-40 s each: minutes, not a test. Prints each survivor (line, what changed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import re
import shutil
import subprocess
import tempfile

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"
CASES = ("prometheus-rules.test.yaml", "prometheus-rules.slow.test.yaml")
_NUMBER = re.compile(r"(?<![\w\[.:$])(\d+\.?\d*)(?![\w\]])")
_FOR = re.compile(r"^(\s+for: )(\d+)([smh])$")
_PROSE = ("#", "summary:", "description:", "runbook_url:", "- record:", "- alert:", "severity:")


def changes(lines: list[str]) -> list[tuple[int, str, str]]:
    """(line index, what changed, the changed line) of every number and ``for`` in the rules' expressions."""
    found = []
    in_prose = False
    for index, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(("description:", "summary:")):
            in_prose = stripped.endswith(">-")
            continue
        if in_prose and line.startswith(" " * 12) and not stripped.startswith(("expr:", "for:", "labels:")):
            continue
        in_prose = False
        if stripped.startswith(_PROSE) or not stripped:
            continue
        if matched := _FOR.match(line.rstrip("\n")):
            value, unit = int(matched[2]), matched[3]
            for new in sorted({value // 2, value * 2} - {value}):
                found.append((index, f"for {value}{unit} -> {new}{unit}", f"{matched[1]}{new}{unit}\n"))
            continue
        for number in _NUMBER.finditer(line):
            value = float(number[1])
            for new in (value / 2, value * 2) if value else (1.0,):
                text = f"{new:g}"
                found.append((index, f"{number[1]} -> {text}", line[:number.start()] + text + line[number.end():]))
    return found


def survives(lines: list[str], change: tuple[int, str, str]) -> bool:
    """Whether every promtool case still passes on the rules with ``change`` made."""
    index, _, new = change
    with tempfile.TemporaryDirectory() as folder:
        changed = list(lines)
        changed[index] = new
        (pathlib.Path(folder) / "prometheus-rules.yaml").write_text("".join(changed))
        for cases in CASES:
            shutil.copy(DEPLOY / cases, folder)
        done = subprocess.run(["promtool", "test", "rules", *CASES], cwd=folder, capture_output=True, text=True)
    return done.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=4)
    args = parser.parse_args()
    lines = (DEPLOY / "prometheus-rules.yaml").read_text().splitlines(keepends=True)
    every = changes(lines)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        survivors = [change for change, alive in zip(every, pool.map(lambda c: survives(lines, c), every)) if alive]
    print(f"{len(every)} changes, {len(survivors)} survive (no promtool case notices them):")
    for index, what, _ in survivors:
        print(f"  line {index + 1}: {what}: {lines[index].strip()[:90]}")


if __name__ == "__main__":
    main()
