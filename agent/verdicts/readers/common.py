"""What the readers share: how a problem is said and what a folder without telemetry lacks, and how a
rank ended, from the reasons of its snapshots."""

from __future__ import annotations

import sys
from typing import Callable


NO_TELEMETRY = "no trace file (*.jsonl) with commlens spans and no flight-recorder dump"
"""What a job's folder without telemetry lacks, as the commands that read one say it."""
NO_TELEMETRY_EXIT = 3
"""The exit status of ``diagnose``, ``timeline`` and ``report`` where the telemetry is missing, could not be
read, or (``diagnose``, nothing wrong found) is incomplete: 2 is a usage error, 1 something wrong."""


def say_skipped(problem: str) -> None:
    print(f"commlens: skipped {problem}", file=sys.stderr)


def kept_and_said(unread: list[str]) -> Callable[[str], None]:
    """An ``on_problem`` that says each problem (``say_skipped``) and keeps it in ``unread``, for the
    verdict's caveats."""
    def problem(line: str) -> None:
        unread.append(line)
        say_skipped(line)
    return problem


def lost(reasons: set[str]) -> bool:
    """Snapshot reasons of a rank that ended without a signal or an exception."""
    return "exit" in reasons and not reasons & {"signal", "exception"}
