"""``commlens timeline``: a job's collectives as one cross-rank timeline, for Perfetto or chrome://tracing.

What it shows and how each rank's clock is aligned (from the collectives the ranks share):
docs/timeline.md.

Example::

    commlens timeline ./commlens-out                # writes ./commlens-out/timeline.json
    commlens timeline ./commlens-out --last 30s -o last.json
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import re
import sys
from typing import Callable, Iterable, Iterator, NamedTuple

from commlens.exporters import names

from .facts import RankFacts
from .detectors import findings
from .readers import NO_TELEMETRY_EXIT, clock_offsets as _offsets, from_files, say_skipped


class Slice(NamedTuple):
    """One rank's span of one collective, with what the timeline shows of it."""

    rank: int
    pg: str
    seq: int
    op: str
    start_ns: int
    end_ns: int
    p2p: bool
    in_flight: bool
    last_bucket: bool
    args: dict
    markers: tuple[str, ...]


_ARGS = {names.BYTES: "bytes", names.STATUS: "status", names.DTYPE: "dtype",
         names.MODULE: "module", names.PHASE: "phase", names.DDP_BUCKET: "ddp.bucket"}
_MARKERS = ((names.NAN, "NaN"), (names.INF, "Inf"), (names.HANG, "hang"))


def _slice(span: dict, a: dict) -> Slice | None:
    if names.RANK not in a:
        return None
    markers = tuple(name for key, name in _MARKERS if a.get(key))
    if a.get(names.STATUS) in ("error", "timeout"):
        markers += (f"collective {a[names.STATUS]}",)
    return Slice(int(a[names.RANK]), str(a[names.PG_NAME]), int(a[names.SEQ]), a[names.OP],
                 int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"]), bool(a.get(names.P2P)),
                 bool(a.get(names.IN_FLIGHT)), bool(a.get(names.DDP_IS_LAST)),
                 {name: a[key] for key, name in _ARGS.items() if key in a} | ({"slow": True} if a.get(names.SLOW) else {}),
                 markers)


def durations_ms(found: Iterable[Slice], key: Callable[[Slice], tuple]) -> dict[tuple, list[float]]:
    """The completed collectives' durations in ms (at least 1 µs: a log scale's), sorted, by ``key``."""
    by: dict[tuple, list[float]] = collections.defaultdict(list)
    for s in found:
        if not s.in_flight:
            by[key(s)].append(max((s.end_ns - s.start_ns) / 1e6, 1e-3))
    return {k: sorted(v) for k, v in by.items()}


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values``, nearest rank: one of them, as the report and the demo show it.

    >>> quantile([1.0, 2.0, 3.0, 4.0], 0.5)
    3.0"""
    return values[min(len(values) - 1, int(q * len(values)))]


def read_facts(folder: str, on_problem: Callable[[str], None] = say_skipped) -> tuple[list[Slice], list[RankFacts]]:
    """The collectives in ``folder``'s trace files, one per rank and collective (a hung one's completed
    span replaces the in-flight one of its hang snapshot), and the facts ``commlens diagnose``'s
    findings are drawn from: both from one pass over the files; ``on_problem`` as ``readers.from_files``'."""
    found: dict[tuple, Slice] = {}

    def keep(span: dict, a: dict) -> None:
        s = _slice(span, a)
        if s is not None:
            key = (s.rank, s.pg, s.seq, s.p2p)
            if key not in found or found[key].in_flight:
                found[key] = s

    facts = from_files(folder, keep, on_problem)
    return sorted(found.values(), key=lambda s: s.start_ns), facts


def clock_offsets(found: Iterable[Slice]) -> dict[int, int]:
    """Each rank's clock minus the job's, in ns, from the ends of the collectives ranks share."""
    return _offsets((s.rank, s.pg, s.seq, s.end_ns) for s in found if not s.p2p and not s.in_flight)


def aligned(found: Iterable[Slice], offsets: dict[int, int]) -> list[Slice]:
    """``found`` on the job's clock (each rank's ``clock_offsets`` subtracted), in order of start."""
    return sorted((s._replace(start_ns=s.start_ns - offsets.get(s.rank, 0), end_ns=s.end_ns - offsets.get(s.rank, 0))
                   for s in found), key=lambda s: s.start_ns)


def _step_ends(found: list[Slice]) -> dict[int, list[int]]:
    """Per rank, the ends of the DDP steps its spans show (the end of each last gradient bucket)."""
    ends: dict[int, list[int]] = collections.defaultdict(list)
    for s in found:
        if s.last_bucket:
            ends[s.rank].append(s.end_ns)
    return {rank: sorted(values) for rank, values in ends.items()}


def _window(found: list[Slice], last_s: float | None, steps: tuple[int, int] | None,
            boundaries: dict[int, list[int]]) -> list[Slice]:
    if last_s is not None and found:
        since = max(s.end_ns for s in found) - int(last_s * 1e9)
        found = [s for s in found if s.end_ns >= since]
    if steps is not None:
        first, last = steps
        found = [s for s in found if first <= bisect.bisect_left(boundaries.get(s.rank, []), s.start_ns) < last]
    return found


def events(folder: str, last_s: float | None = None, steps: tuple[int, int] | None = None,
           read_as: tuple[list[Slice], list] | None = None) -> tuple[Iterator[dict], dict]:
    """The trace events of the job in ``folder`` (docs/timeline.md), as they are made, and the
    document's ``otherData``; ``read_as``: its collectives and findings, where the caller has them."""
    if read_as is None:
        found, facts = read_facts(folder)
        read_as = found, findings(facts)
    found, verdicts = read_as
    if not found:
        raise ValueError(f"no telemetry in {folder}: no trace file (*.jsonl) with commlens spans")
    offsets = clock_offsets(found)
    found = aligned(found, offsets)
    boundaries = _step_ends(found)
    if steps is not None and not boundaries:
        raise ValueError("--steps needs the steps' ends, which only a DDP model's last gradient buckets give; "
                         "this job's spans hold none: use --last")
    found = _window(found, last_s, steps, boundaries)
    other = {"source": os.path.abspath(folder), "clock_offsets_ns": {str(r): o for r, o in offsets.items()}}
    return _made(found, verdicts, boundaries), other


def _made(found: list[Slice], verdicts: list, boundaries: dict[int, list[int]]) -> Iterator[dict]:
    origin = min((s.start_ns for s in found), default=0)

    def us(ns: int) -> float:
        return (ns - origin) / 1e3

    groups = sorted({s.pg for s in found}, key=lambda pg: (len(pg), pg))
    tids = {pg: i + 1 for i, pg in enumerate(groups)}
    ranks = sorted({s.rank for s in found})
    for rank in ranks:
        yield {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
        yield {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}
        yield {"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "steps"}}
        for pg in groups:
            yield {"ph": "M", "name": "thread_name", "pid": rank, "tid": tids[pg], "args": {"name": f"group {pg}"}}
    for s in found:
        yield {"ph": "X", "name": s.op, "cat": "collective", "pid": s.rank, "tid": tids[s.pg], "ts": us(s.start_ns),
               "dur": max((s.end_ns - s.start_ns) / 1e3, 0.001), "args": {"group": s.pg, "seq": s.seq, **s.args}}
        for marker in s.markers:
            yield {"ph": "i", "s": "t", "name": marker, "cat": "anomaly", "pid": s.rank, "tid": tids[s.pg],
                   "ts": us(s.start_ns), "args": {"op": s.op, "seq": s.seq, "group": s.pg}}
    yield from _flows(found, tids, us)
    yield from _steps(boundaries, set(ranks), found, us)
    yield from _verdicts(verdicts, found, us)


def _flows(found: list[Slice], tids: dict[str, int], us) -> Iterator[dict]:
    """Arrows through the ranks of each (group, seq), first arrival to last."""
    joined: dict[tuple[str, int], list[Slice]] = collections.defaultdict(list)
    for s in found:  # in order of (aligned) start: each list is in arrival order
        if not s.p2p:
            joined[(s.pg, s.seq)].append(s)
    flow_id = 0
    for (pg, seq), members in joined.items():
        if len(members) < 2:
            continue
        flow_id += 1
        for i, s in enumerate(members):
            phase = "s" if i == 0 else "f" if i == len(members) - 1 else "t"
            yield {"ph": phase, "id": flow_id, "name": f"{s.op} seq {seq}", "cat": "arrival", "pid": s.rank,
                   "tid": tids[pg], "ts": us(s.start_ns), **({"bp": "e"} if phase == "f" else {})}


def _steps(boundaries: dict[int, list[int]], ranks: set[int], found: list[Slice], us) -> Iterator[dict]:
    first = {s.rank: s.start_ns for s in reversed(found)}  # found is in order of start: each rank's earliest
    for rank in sorted(ranks & set(boundaries)):
        starts = [first[rank]] + boundaries[rank][:-1]
        for step, (start, end) in enumerate(zip(starts, boundaries[rank])):
            if end > start:
                yield {"ph": "X", "name": f"step {step}", "cat": "step", "pid": rank, "tid": 0, "ts": us(start),
                       "dur": (end - start) / 1e3}


def _verdicts(verdicts: list, found: list[Slice], us) -> Iterator[dict]:
    """A marker for each verdict of ``commlens diagnose``, on each rank it names: at the collective it
    names where the timeline holds it, else at that rank's last collective."""
    where = {(s.rank, s.pg, s.seq): s.start_ns for s in found if not s.p2p}
    last: dict[int, int] = {}
    for s in found:
        last[s.rank] = max(last.get(s.rank, s.end_ns), s.end_ns)
    for finding in verdicts:
        for rank in finding.ranks:
            ts = where.get((rank, finding.pg, finding.seq), last.get(rank))
            if ts is not None:
                yield {"ph": "i", "s": "p", "name": f"verdict: {finding.kind.replace('_', ' ')}", "cat": "verdict",
                       "pid": rank, "ts": us(ts), "args": {"verdict": finding.line()}}


OPEN_IN = "open it in https://ui.perfetto.dev or chrome://tracing"


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)?", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not accepted: give a duration such as 30s, 500ms, 5m or 1h")
    return float(match[1]) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, None: 1}[match[2]]


def _step_range(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if not match or int(match[1]) >= int(match[2]):
        raise argparse.ArgumentTypeError(f"{text!r} is not accepted: give A:B with A < B, steps A to B-1 (from 0)")
    return int(match[1]), int(match[2])


def write(folder: str, path: str | None = None, last_s: float | None = None,
          steps: tuple[int, int] | None = None, read: tuple[list[Slice], list] | None = None) -> str:
    """Write the timeline of the job in ``folder`` to ``path`` (default ``folder/timeline.json``);
    ``read``: as ``events``' ``read_as``."""
    path = path or os.path.join(folder, "timeline.json")
    made, other = events(folder, last_s, steps, read)
    with open(path, "w") as f:  # event by event: a long job's timeline is never held whole
        f.write('{"displayTimeUnit":"ms","otherData":' + json.dumps(other) + ',"traceEvents":[')
        for i, event in enumerate(made):
            f.write(("," if i else "") + json.dumps(event, separators=(",", ":")))
        f.write("]}")
    return path


def main(argv: list[str] | None = None) -> int:
    """``commlens timeline FOLDER``: write the timeline and say where to open it."""
    parser = argparse.ArgumentParser(
        prog="commlens timeline", description="A cross-rank timeline of a job's collectives, for ui.perfetto.dev "
        "or chrome://tracing, from its trace files.")
    parser.add_argument("folder", help="a job's trace files (*.jsonl), as commlens run or the demo wrote them")
    parser.add_argument("-o", "--output", help="the trace file to write (default: FOLDER/timeline.json)")
    window = parser.add_mutually_exclusive_group()
    window.add_argument("--last", type=_seconds, metavar="DURATION", help="only the last DURATION of the job (30s, 5m)")
    window.add_argument("--steps", type=_step_range, metavar="A:B",
                        help="only DDP steps A to B-1, counted from the first step in the files")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.folder):
        parser.error(f"{args.folder!r} is not a folder: give the folder of a job's trace files")
    try:
        path = write(args.folder, args.output, args.last, args.steps)
    except ValueError as error:
        print(f"commlens timeline: {error}", file=sys.stderr)
        return NO_TELEMETRY_EXIT
    print(f"timeline: {path} ({OPEN_IN})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
