"""The shipped alert rules at the scrape interval Prometheus runs at (``commlens assets --scrape-interval``).

``deploy/prometheus-rules.yaml`` is written for scrapes of ``WRITTEN_FOR_S`` or less: its shortest
windows hold 4 scrapes there (10 s). At a longer interval a 10 s ``rate()`` holds two samples or fewer
and its rules go quiet or slip; ``at_interval`` widens every window below 4 scrape intervals to 4 (a range, and
the ``offset`` that asks whether a series was there as a window began), and every ``for`` below one
interval to one, and the prose that quotes them.

Example::

    rules = at_interval(pathlib.Path("deploy/prometheus-rules.yaml").read_text(), 30)   # kube-prometheus' 30 s
"""

from __future__ import annotations

import re

WRITTEN_FOR_S = 2
"""The longest scrape interval the rules file as written works at."""
INTERVALS_S = (1, 60)
"""The scrape intervals ``at_interval`` takes, in seconds (both ends included)."""
WINDOW_SCRAPES, FOR_SCRAPES = 4, 1
"""A range holds at least this many scrape intervals (a ``rate()`` needs two samples, a target's scrape
lands anywhere in its interval); an alert's ``for`` at least this many (every target scraped once more
before it fires on what a scrape of one showed before another's)."""

_UNITS = {"s": 1, "m": 60, "h": 3600}
_RANGE = re.compile(r"\[(\d+)([smh])(:\d+[smh])?\]")
_OFFSET = re.compile(r"\boffset (\d+)([smh])\b")
"""An offset of ``WRITTEN_FOR_S`` or more is a window's length (a series there as the window began); a
shorter one is about the rules' evaluation (the last one), whatever the scrape interval."""
_FOR = re.compile(r"^(\s+for: )(\d+)([smh])$", re.MULTILINE)
_QUOTED = re.compile(r"the last (\d+) (s|min)\b")
"""How the rules' comments and descriptions quote a window."""


def parse_interval(text: str) -> int:
    """Seconds in a scrape interval written as Prometheus writes one (``15s``, ``1m``); ``ValueError``
    naming what is accepted."""
    found = re.fullmatch(r"(\d+)([sm])", text.strip())
    seconds = int(found[1]) * _UNITS[found[2]] if found else 0
    if not INTERVALS_S[0] <= seconds <= INTERVALS_S[1]:
        raise ValueError(f"{text!r} is not accepted: give a scrape interval of {INTERVALS_S[0]}s to "
                         f"{INTERVALS_S[1]}s, as Prometheus writes it (15s, 30s, 1m)")
    return seconds


def window_s(written_s: int, interval_s: int) -> int:
    """A window the rules write as ``written_s`` seconds, at scrapes every ``interval_s``: at least
    ``WINDOW_SCRAPES`` intervals. ``window_s(10, 30) == 120``; ``window_s(300, 30) == 300``."""
    return max(written_s, WINDOW_SCRAPES * interval_s)


def at_interval(rules: str, interval_s: int) -> str:
    """``rules`` (the text of ``prometheus-rules.yaml``) for scrapes every ``interval_s`` seconds: each
    range under ``WINDOW_SCRAPES`` intervals and each ``for`` under ``FOR_SCRAPES`` widened to them;
    ``rules`` itself at ``WRITTEN_FOR_S`` or less."""
    window, hold = WINDOW_SCRAPES * interval_s, FOR_SCRAPES * interval_s

    def widened(found: re.Match) -> str:
        seconds = int(found[1]) * _UNITS[found[2]]
        return found[0] if seconds >= window else f"[{_duration(window)}{found[3] or ''}]"

    def offset(found: re.Match) -> str:
        seconds = int(found[1]) * _UNITS[found[2]]
        return found[0] if seconds < WRITTEN_FOR_S or seconds >= window else f"offset {_duration(window)}"

    def held(found: re.Match) -> str:
        seconds = int(found[2]) * _UNITS[found[3]]
        return found[0] if seconds >= hold else f"{found[1]}{_duration(hold)}"

    def quoted(found: re.Match) -> str:
        seconds = int(found[1]) * (60 if found[2] == "min" else 1)
        return found[0] if seconds >= window else f"the last {_duration(window, ' ')}"

    return _QUOTED.sub(quoted, _FOR.sub(held, _OFFSET.sub(offset, _RANGE.sub(widened, rules))))


def prometheus_rule(rules: str, interval_s: int, source: str = "deploy/prometheus-rules.yaml") -> str:
    """The PrometheusRule (Prometheus operator) holding ``rules``' groups at ``interval_s``, comments kept."""
    groups = at_interval(rules, interval_s)
    groups = groups[groups.index("\ngroups:") + 1:]
    return (f"# Built from {source} for scrapes every {_duration(interval_s, ' ')} (commlens.agent.verdicts.rule_files); "
            "do not edit\napiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\nmetadata:\n  name: commlens\n"
            "  labels:\n    app.kubernetes.io/part-of: commlens\nspec:\n"
            + "".join(f"  {line}" if line.strip() else line for line in groups.splitlines(keepends=True)))


def _duration(seconds: int, space: str = "") -> str:
    """``seconds`` as Prometheus writes a duration (``1m``, ``90s``), or prose (``1 min``) with ``space``."""
    if seconds % 60 == 0:
        return f"{seconds // 60}{space}{'min' if space else 'm'}"
    return f"{seconds}{space}s"
