"""The verdict: which rank, which collective, why — from telemetry alone (``commlens diagnose``).

Facts come live from the ranks' metrics endpoints or Prometheus, or after the fact from a job's
folder; ``verdicts.findings`` judges them. The findings: docs/verdicts.md.

Example::

    commlens diagnose ./commlens-out/job-7
    commlens diagnose --metrics http://node1:9464/metrics http://node1:9465/metrics
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.parse

from .facts import RankFacts
from .detectors import findings
from .finding import Finding
from .readers import (NO_TELEMETRY, NO_TELEMETRY_EXIT, QUERY_TIMEOUT_S, attempts_in, from_endpoints, from_files,
                      from_prometheus, kept_and_said)


def main(argv: list[str] | None = None) -> int:
    """``commlens diagnose``: print the verdict (of each job; of each attempt of a job restarted by
    torchrun); exit status 1 when something is wrong in any, else 2 when the telemetry is missing or
    incomplete (``caveats``), else 0."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="commlens diagnose", description="Name the rank, collective and cause of what went wrong in a job.",
        epilog="Examples: commlens diagnose ./commlens-out   |   commlens diagnose --metrics "
        "http://node1:9464/metrics http://node1:9465/metrics   |   commlens diagnose --prometheus http://prom:9090 --job train-42")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("folder", nargs="?", help="a job's trace files (*.jsonl) and flight-recorder dumps")
    source.add_argument("--metrics", nargs="+", metavar="URL", help="the ranks' metrics endpoints, live")
    source.add_argument("--prometheus", metavar="URL", help="a Prometheus server that scrapes the ranks, live")
    parser.add_argument("--job", help="with --prometheus: the job label to look at (default: every job)")
    parser.add_argument("--query-timeout", type=float, default=QUERY_TIMEOUT_S, metavar="SECONDS",
                        help=f"with --prometheus: seconds each query is waited for (default {QUERY_TIMEOUT_S:g})")
    parser.add_argument("--window", type=float, default=5.0,
                        help="with --metrics: seconds between the two scrapes that waits are measured over")
    args = parser.parse_args(argv)
    if not args.window > 0:
        parser.error(f"--window {args.window} is not accepted: give the seconds between the two scrapes, above 0")
    if not args.query_timeout > 0:
        parser.error(f"--query-timeout {args.query_timeout} is not accepted: "
                     "give the seconds a query is waited for, above 0")
    if args.prometheus and urllib.parse.urlsplit(args.prometheus).scheme not in ("http", "https"):
        parser.error(f"--prometheus {args.prometheus!r} is not accepted: give its URL, e.g. http://prom:9090")
    if args.folder is not None and not os.path.isdir(args.folder):
        parser.error(f"{args.folder!r} is not a folder: give the folder of a job's trace files and dumps")
    jobs: list[tuple[str, list[RankFacts], list[str]]] = []
    """Each job's (or attempt's) label, facts, and what of its telemetry could not be read."""
    try:
        if args.prometheus:
            jobs = [(job, facts, []) for job, facts in sorted(from_prometheus(args.prometheus, args.job, args.query_timeout).items())]
        elif args.metrics:
            unread: list[str] = []
            jobs = [("", from_endpoints(args.metrics, args.window, on_problem=kept_and_said(unread)), unread)]
        else:
            attempts = attempts_in(args.folder)
            for attempt, folder in attempts:  # an elastic restart's attempts, each judged alone
                unread = []
                label = f"attempt {attempt}" if len(attempts) > 1 else ""
                jobs.append((label, from_files(folder, on_problem=kept_and_said(unread)), unread))
    except OSError as error:
        source = args.prometheus or args.folder or " ".join(args.metrics)
        why = _why(error)
        if args.prometheus and isinstance(getattr(error, "reason", error), TimeoutError):
            why = f"no answer to a query within {args.query_timeout:g} s (--query-timeout gives a slow store longer)"
        print(f"commlens diagnose: cannot read the telemetry from {source}: {why}", file=sys.stderr)
        return NO_TELEMETRY_EXIT
    if not any(facts for _, facts, _ in jobs):
        where = args.folder or " ".join(args.metrics or ()) or f"{args.prometheus}" + (f" (job {args.job})" if args.job else "")
        what = NO_TELEMETRY if args.folder else "no commlens metrics"
        print(f"commlens diagnose: no telemetry in {where}: {what}", file=sys.stderr)
        return NO_TELEMETRY_EXIT
    wrong = incomplete = False
    for job, facts, unread in jobs:
        lines = report(facts, unread)
        wrong, incomplete = wrong or not lines[0].startswith(NOTHING_WRONG), incomplete or bool(caveats(facts, unread))
        for line in lines:
            print(f"{job}: {line}" if job else line)
    return 1 if wrong else NO_TELEMETRY_EXIT if incomplete else 0


def _why(error: OSError) -> str:
    """What went wrong, in the words of the socket or the server, not urllib's wrapping of them."""
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code} {error.reason}"
    reason = getattr(error, "reason", error)  # a URLError wraps the socket's error
    return getattr(reason, "strerror", None) or str(reason)


NOTHING_WRONG = "nothing wrong found"
IN_WHAT_WAS_SEEN = ", in what commlens saw"


def report(facts: list[RankFacts], unread: list[str] = ()) -> list[str]:
    """The verdict as lines: ``verdict``'s, then ``notes``' (what is no fault), then ``caveats``'."""
    unseen = caveats(facts, unread)
    return verdict(findings(facts), unseen) + notes(facts) + unseen


def verdict(found: list[Finding], unseen: list[str]) -> list[str]:
    """One line per finding, or ``NOTHING_WRONG`` (", in what commlens saw" where there are caveats)."""
    return [finding.line() for finding in found] or [NOTHING_WRONG + (IN_WHAT_WAS_SEEN if unseen else "")]


def caveats(facts: list[RankFacts], unread: list[str]) -> list[str]:
    """What the verdict could not see: ranks that ran without commlens, and files, lines or endpoints
    that could not be read (each named in ``unread``, the rest still used).

    >>> caveats([RankFacts(2, unobserved="port 9466 is in use")], ["rank_9 is not a flight-recorder dump"])
    ['not observed: rank 2 ran without commlens (port 9466 is in use)', 'not read: rank_9 is not a flight-recorder dump']
    """
    return ([f"not observed: rank {f.rank} ran without commlens ({f.unobserved})" for f in facts if f.unobserved]
            + [f"not read: {line}" for line in unread])


def notes(facts: list[RankFacts]) -> list[str]:
    """What the telemetry shows that is no fault: a loss scaler's skipped steps.

    >>> notes([RankFacts(0, loss_scale_skipped=3), RankFacts(1, loss_scale_skipped=3)])
    ['no fault: the loss scaler skipped 3 steps for Inf or NaN in the gradients (ranks 0, 1): its overflow']
    """
    skipped = {f.rank: f.loss_scale_skipped for f in facts if f.loss_scale_skipped}
    if not skipped:
        return []
    ranks = ", ".join(map(str, sorted(skipped)))
    return [f"no fault: the loss scaler skipped {max(skipped.values())} steps for Inf or NaN in the gradients "
            f"(rank{'s' if len(skipped) > 1 else ''} {ranks}): its overflow"]
