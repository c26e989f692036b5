"""``commlens report``: a job's folder as one self-contained HTML page, to open from disk.

What the page holds: docs/timeline.md ("The report").

Example::

    commlens report commlens-out/train-42          # writes commlens-out/train-42/report.html
"""

from __future__ import annotations

import argparse
import collections
import html
import math
import os
import sys

from .diagnose import caveats, notes
from .diagnose import verdict as verdict_lines
from .facts import RankFacts
from .detectors import findings
from .readers import NO_TELEMETRY, NO_TELEMETRY_EXIT, kept_and_said
from .timeline import Slice, aligned, clock_offsets, durations_ms, quantile, read_facts

WIDTH = 1100
"""The timeline's width in pixels."""
LANE = 22
DRAWN = 20_000
"""Spans drawn on the timeline at most (every anomaly, then the others evenly): a page stays light."""
EVENTS = 200
"""Anomalies listed at most, the first ones."""
BINS_PER_DECADE = 8
"""The latency distribution's bins, on a log scale."""
_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #1d2330; max-width: 1180px }
h1 { font-size: 22px; margin: 0 0 4px } h2 { font-size: 16px; margin: 28px 0 8px }
.meta { color: #5b6475 } .verdict { padding: 10px 14px; border-radius: 6px; font-family: ui-monospace, monospace }
.bad { background: #fdecec; border: 1px solid #e5a3a3 } .ok { background: #e9f7ee; border: 1px solid #9fd3b0 }
.note { background: #eef3fb; border: 1px solid #a9bfe3; margin-top: 6px }
.caveat { background: #fff6e0; border: 1px solid #e0c27a; margin-top: 6px }
table { border-collapse: collapse } th, td { padding: 3px 10px; text-align: right; border-bottom: 1px solid #e3e6ec }
th:first-child, td:first-child, td.text { text-align: left } svg text { font: 11px system-ui, sans-serif }
"""
_COLORS = {"NaN": "#8e44ad", "Inf": "#8e44ad", "hang": "#d62728", "collective error": "#d62728",
           "collective timeout": "#d62728"}


def render(folder: str) -> str:
    """The report of the job in ``folder`` as HTML text; ValueError if the folder holds no telemetry."""
    unread: list[str] = []
    return page(folder, *read_facts(folder, kept_and_said(unread)), unread)


def page(folder: str, found: list[Slice], facts: list[RankFacts], unread: list[str]) -> str:
    """``render``'s page, of what ``timeline.read_facts`` read from ``folder`` (``unread``: what it
    could not read, each named). Without spans (a collector took them), the verdict of the dumps alone."""
    if not facts:
        raise ValueError(f"no telemetry in {folder}: {NO_TELEMETRY}")
    found = aligned(found, clock_offsets(found))
    verdict, unseen = findings(facts), caveats(facts, unread)
    lines = verdict_lines(verdict, unseen)
    ranks, groups = sorted({s.rank for s in found} or {f.rank for f in facts}), len({s.pg for s in found})
    seconds = (max(s.end_ns for s in found) - found[0].start_ns) / 1e9 if found else 0.0
    spans = (f"{groups} group{'s' * (groups > 1)} · {len(found):,} spans kept over {seconds:.1f} s" if found else
             "no spans in the folder (a collector took them, or the trace files went elsewhere): the verdict is of the "
             "dumps and notes alone")
    parts = [f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>commlens report: "
             f"{_e(os.path.basename(os.path.abspath(folder)))}</title><style>{_STYLE}</style></head><body>",
             "<h1>commlens report</h1>",
             f"<p class=meta>{_e(os.path.abspath(folder))} · {len(ranks)} rank{'s' * (len(ranks) > 1)} · {spans}</p>",
             "<h2>Verdict</h2>",
             *(f"<div class='verdict {'bad' if verdict else 'ok'}' id=verdict>{_e(line)}</div>" for line in lines),
             *(f"<div class='verdict note'>{_e(line)}</div>" for line in notes(facts)),
             *(f"<div class='verdict caveat'>{_e(line)}</div>" for line in unseen)]
    if found:
        parts += ["<h2>Timeline</h2>", _timeline(found, ranks, verdict), "<h2>Ranks</h2>", _ranks(found, ranks),
                  "<h2>Latency by op and group</h2>", _latency(found), "<h2>Anomalies</h2>", _anomalies(found)]
    return "\n".join(parts + ["</body></html>"])


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _timeline(found: list[Slice], ranks: list[int], verdict: list) -> str:
    t0, t1 = found[0].start_ns, max(s.end_ns for s in found)
    scale = (WIDTH - 60) / max(t1 - t0, 1)
    lane = {rank: i for i, rank in enumerate(ranks)}
    anomalies = [s for s in found if s.markers]
    others = [s for s in found if not s.markers]
    step = max(1, len(others) // max(1, DRAWN - len(anomalies)))
    height = LANE * len(ranks) + 30
    out = [f"<svg width={WIDTH} height={height} role=img aria-label='cross-rank timeline'>"]
    for rank in ranks:
        y = lane[rank] * LANE
        out.append(f"<text x=0 y={y + 15}>rank {rank}</text><line x1=60 x2={WIDTH} y1={y + LANE - 1} "
                   f"y2={y + LANE - 1} stroke=#eef0f4 />")
    for s in others[::step] + anomalies:
        x, width = 60 + (s.start_ns - t0) * scale, max(1.0, (s.end_ns - s.start_ns) * scale)
        color = next((_COLORS[m] for m in s.markers if m in _COLORS), "#7f8ea3")
        out.append(f"<rect x={x:.1f} y={lane[s.rank] * LANE + 3} width={width:.1f} height={LANE - 8} fill={color}>"
                   f"<title>rank {s.rank} {_e(s.op)} group {_e(s.pg)} seq {s.seq}: "
                   f"{(s.end_ns - s.start_ns) / 1e6:.2f} ms {_e(' '.join(s.markers))}</title></rect>")
    where = {(s.rank, s.pg, s.seq): s.start_ns for s in found if not s.p2p}
    for finding in verdict:
        for rank in finding.ranks:
            at = where.get((rank, finding.pg, finding.seq))
            if at is not None and rank in lane:
                x, y = 60 + (at - t0) * scale, lane[rank] * LANE
                out.append(f"<path d='M{x:.1f},{y + 1} l5,8 l-10,0 z' fill=#d62728><title>{_e(finding.line())}</title></path>")
    out.append(f"<text x=60 y={height - 8}>0 s</text><text x={WIDTH - 60} y={height - 8}>{(t1 - t0) / 1e9:.2f} s</text>")
    caption = (f"<p class=meta>{len(others[::step]) + len(anomalies):,} of {len(found):,} spans drawn; grey: "
               "collectives, purple: NaN/Inf, red: hangs and failures, red triangles: the ranks the verdict names. "
               "Hover for each span.</p>")
    return "".join(out) + "</svg>" + caption


def _ranks(found: list[Slice], ranks: list[int]) -> str:
    """Per rank: spans, seconds in them, of which waiting for the others, and anomalies. A rank's wait in
    a group collective is its time in it beyond the quickest member's (that one arrived last: its time
    is the transfer), over the collectives kept of every member."""
    spans, seconds, waited = collections.Counter(), collections.Counter(), collections.Counter()
    marked: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    members: dict[str, set[int]] = collections.defaultdict(set)
    by_seq: dict[tuple[str, int], list[Slice]] = collections.defaultdict(list)
    for s in found:
        spans[s.rank] += 1
        seconds[s.rank] += (s.end_ns - s.start_ns) / 1e9
        marked[s.rank].update(s.markers)
        if not s.p2p:
            members[s.pg].add(s.rank)
            if not s.in_flight:
                by_seq[(s.pg, s.seq)].append(s)
    for (pg, _), kept in by_seq.items():
        if len(kept) == len(members[pg]) > 1:
            quickest = min(s.end_ns - s.start_ns for s in kept)
            for s in kept:
                waited[s.rank] += (s.end_ns - s.start_ns - quickest) / 1e9
    rows = "".join(f"<tr><td>{rank}</td><td>{spans[rank]:,}</td><td>{seconds[rank]:.3f}</td><td>{waited[rank]:.3f}</td>"
                   f"<td>{marked[rank]['NaN'] + marked[rank]['Inf']}</td><td>{marked[rank]['hang']}</td>"
                   f"<td>{sum(n for m, n in marked[rank].items() if m.startswith('collective'))}</td></tr>"
                   for rank in ranks)
    return ("<table><tr><th>rank</th><th>spans kept</th><th>seconds in them</th><th>of which waiting for others</th>"
            f"<th>NaN/Inf</th><th>hangs</th><th>failed</th></tr>{rows}</table><p class=meta>A rank that waits least "
            "in a group arrives last there: the others wait for it.</p>")


def _latency(found: list[Slice]) -> str:
    """Per op and group: percentiles, and the distribution on one log scale for all rows (bars: the spans
    in each bin, against the row's fullest; hover for the counts)."""
    by = durations_ms(found, lambda s: (s.op, s.pg))
    if not by:
        return "<p class=meta>none completed</p>"
    low = math.floor(math.log10(min(min(v) for v in by.values())))
    high = max(low + 1, math.ceil(math.log10(max(max(v) for v in by.values()))))
    bins, width = BINS_PER_DECADE * (high - low), 4
    rows = []
    for (op, pg), values in sorted(by.items()):
        counts = collections.Counter(min(bins - 1, int((math.log10(v) - low) * BINS_PER_DECADE)) for v in values)
        top = max(counts.values())
        bars = "".join(f"<rect x={b * width} y={18 - 18 * n / top:.1f} width={width - 1} "
                       f"height={18 * n / top:.1f} fill=#5b7bd5><title>{n:,} spans from "
                       f"{10 ** (low + b / BINS_PER_DECADE):.3g} ms</title></rect>" for b, n in sorted(counts.items()))
        rows.append(f"<tr><td>{_e(op)}</td><td>{_e(pg)}</td><td>{len(values):,}</td><td>{quantile(values, 0.1):.3f}</td>"
                    f"<td>{quantile(values, 0.5):.3f}</td><td>{quantile(values, 0.9):.3f}</td>"
                    f"<td>{quantile(values, 0.99):.3f}</td>"
                    f"<td>{values[-1]:.3f}</td><td class=text><svg width={bins * width} height=18 role=img "
                    f"aria-label='latency distribution of {_e(op)} in group {_e(pg)}'>{bars}</svg></td></tr>")
    return ("<table><tr><th>op</th><th>group</th><th>spans</th><th>p10 ms</th><th>median ms</th><th>p90 ms</th>"
            f"<th>p99 ms</th><th>max ms</th><th class=text>distribution, {10 ** low:g} to {10 ** high:g} ms (log)</th>"
            "</tr>" + "".join(rows) + "</table>")


def _anomalies(found: list[Slice]) -> str:
    """NaN/Inf, hangs, failures, and collectives a rank waited in long (over ``COMMLENS_SLOW_FACTOR``
    times their usual: the others arrived late)."""
    marked = [s._replace(markers=s.markers + (("waited long",) if s.args.get("slow") else ())) for s in found
              if s.markers or s.args.get("slow")]
    if not marked:
        return "<p class=meta>none: no NaN/Inf, hang, failed collective or long wait in the spans</p>"
    t0 = found[0].start_ns
    rows = "".join(f"<tr><td>{(s.start_ns - t0) / 1e9:.3f}</td><td>{s.rank}</td><td class=text>{_e(s.op)}</td>"
                   f"<td>{_e(s.pg)}</td><td>{s.seq}</td><td>{(s.end_ns - s.start_ns) / 1e6:.2f}</td>"
                   f"<td class=text>{_e(', '.join(s.markers))}</td></tr>" for s in marked[:EVENTS])
    more = f"<p class=meta>the first {EVENTS} of {len(marked):,}</p>" if len(marked) > EVENTS else ""
    return ("<table><tr><th>at s</th><th>rank</th><th>op</th><th>group</th><th>seq</th><th>ms</th><th>what</th></tr>"
            f"{rows}</table>{more}")


def write(folder: str, path: str | None = None) -> str:
    """Write the report of the job in ``folder`` to ``path`` (default ``folder/report.html``)."""
    path = path or os.path.join(folder, "report.html")
    text = render(folder)
    with open(path, "w", encoding="utf-8", errors="backslashreplace") as f:
        f.write(text)
    return path


def main(argv: list[str] | None = None) -> int:
    """``commlens report FOLDER``: write the report and say where it is."""
    parser = argparse.ArgumentParser(prog="commlens report", description="A job's verdict, timeline, ranks, "
                                     "latencies and anomalies as one HTML page, from its trace files.")
    parser.add_argument("folder", help="a job's trace files (*.jsonl), as commlens run or the demo wrote them")
    parser.add_argument("-o", "--output", help="the page to write (default: FOLDER/report.html)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.folder):
        parser.error(f"{args.folder!r} is not a folder: give the folder of a job's trace files")
    try:
        path = write(args.folder, args.output)
    except ValueError as error:
        print(f"commlens report: {error}", file=sys.stderr)
        return NO_TELEMETRY_EXIT
    print(f"report: {path} (open it in a browser)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
