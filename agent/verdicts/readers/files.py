"""Ranks' facts from a job's folder: its OTLP JSON-lines trace files, its flight-recorder dumps (read
without running code) and the notes ranks leave (ended cleanly, commlens not started), on the job's clock.

Example::

    facts = from_files("./commlens-out/job-7")
"""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import pickle
import re
import statistics
from typing import Callable, Iterable, Iterator

from commlens.exporters import names
from commlens.ring.dumps import ATTEMPT_FOLDER, DUMP_REASONS, DUMP_SIGNALLED, ENDED

from ..facts import END_WINDOW_S, RankFacts, ranges
from .common import lost, say_skipped


NOT_STARTED = "not-started-{rank}.json"
"""A rank's note in its job's folder that commlens did not start in it (``{"rank": 3, "error": "..."}``):
``commlens run``'s ``sitecustomize`` (agent/autostart) writes it, under the name it sets, and trains on."""


class _PlainUnpickler(pickle.Unpickler):
    """Admits plain containers and scalars only: reading a dump never runs code."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refused {module}.{name}: a flight-recorder dump holds plain data only")


def load_dump(path: str) -> dict:
    """A flight-recorder dump, read without running code; a clear error for anything else."""
    with open(path, "rb") as f:
        try:
            data = _PlainUnpickler(f).load()
        except Exception as error:
            raise ValueError(f"{path} is not a flight-recorder dump: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path} is not a flight-recorder dump: no list of entries")
    return data


def from_files(folder: str, each_span: Callable[[dict, dict], None] | None = None,
               on_problem: Callable[[str], None] = say_skipped) -> list[RankFacts]:
    """Facts from the OTLP JSON-lines trace files (``*.jsonl``) and flight-recorder dumps in ``folder``;
    ``each_span(span, attributes)`` sees every span as it is read (on its rank's clock), for a caller that
    needs them too. Span times are compared on the job's clock: each rank's ``clock_offsets`` taken off.
    What cannot be read (a corrupt line, a file of the wrong shape) is skipped, the rest still used,
    and ``on_problem`` gets one line naming it and what was wrong (default: printed to stderr)."""
    ranks: dict[int, RankFacts] = {}
    completed: set[tuple[int, str, int]] = set()
    seen, world = set(), 0  # the ranks any span is of; the job's size, as the spans say it
    spans = list(spans_in(folder, on_problem))
    offsets = clock_offsets(_collective_ends(spans))  # each node's clock may differ: the job's clock
    spent = _TimeInCollectives()
    for raw, attributes in spans:
        span = _on_the_jobs_clock(raw, offsets.get(_rank_of(attributes), 0))
        try:
            _span_fact(ranks, span, attributes, completed)
            spent.add(span, attributes)
            if names.RANK in attributes:
                seen.add(int(attributes[names.RANK]))
                world = max(world, int(attributes.get(names.WORLD_SIZE, 0)))
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            on_problem(f"a span {span.get('name')!r} of {folder}: no valid {error} attribute")
            continue
        if each_span is not None:
            each_span(raw, attributes)
    for rank in seen:  # a rank whose spans were all point-to-point ops it did not wait in long
        ranks.setdefault(rank, RankFacts(rank))
    spent.settle(ranks)
    for f in ranks.values():  # a hang that the spans show resolved is no longer in flight
        for pg, group in f.groups.items():
            if group.hung is not None and (f.rank, pg, group.hung[1]) in completed:
                group.hung = None
    for path in sorted(glob.glob(os.path.join(folder, NOT_STARTED.format(rank="*")))):
        try:
            with open(path) as f:
                note = json.load(f)
            ranks.setdefault(int(note["rank"]), RankFacts(int(note["rank"]))).unobserved = str(note["error"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            on_problem(f"{path}: not a note of a rank commlens did not start in ({error})")
    ended = set()
    for path in sorted(glob.glob(os.path.join(folder, ENDED.format(rank="*")))):
        try:
            with open(path) as f:
                ended.add(int(json.load(f)["rank"]))
        except (OSError, ValueError, KeyError, TypeError) as error:
            on_problem(f"{path}: not a note of a rank that ended ({error})")
    dumped = set()
    for path in sorted(glob.glob(os.path.join(folder, "*"))):
        digits = len(path) - len(path.rstrip("0123456789"))
        if not digits or os.path.isdir(path):
            continue
        try:
            dump = load_dump(path)
            collectives = _collectives(path, dump["entries"])
        except (OSError, ValueError) as error:
            on_problem(str(error))
            continue
        dumped.add(int(path[-digits:]))
        _dump_fact(ranks.setdefault(int(path[-digits:]), RankFacts(int(path[-digits:]))), dump, collectives)
    for rank in seen - dumped - ended:  # where the others left theirs: it had no chance to write
        ranks[rank].vanished = not ranks[rank].unobserved and bool((dumped | ended) - {rank})
    for f in ranks.values():  # the dump's signal time, on its rank's clock
        if f.signalled_ns is not None:
            f.signalled_ns -= offsets.get(f.rank, 0)
    missing = sorted(set(range(world)) - seen - set(ranks))
    if missing:  # another node's, where each node keeps its own folder; or lost
        on_problem(f"rank{'s' * (len(missing) > 1)} {ranges(missing)} of the job's {world}: nothing of "
                   f"{'them' if len(missing) > 1 else 'it'} in {folder} (no span, no dump)")
    return [ranks[rank] for rank in sorted(ranks)]


def clock_offsets(ends: Iterable[tuple[int, str, int, int]]) -> dict[int, int]:
    """Each rank's clock minus the job's, in ns, from ``(rank, pg, seq, end ns)`` of the collectives it
    completed: the ranks of a collective complete it together, so a rank's end less the median rank's,
    over every collective it shared, is its clock's offset (nodes' clocks differ; docs/timeline.md)."""
    by_collective: dict[tuple[str, int], dict[int, int]] = collections.defaultdict(dict)
    for rank, pg, seq, end in ends:
        by_collective[(pg, seq)][rank] = end
    deltas: dict[int, list[int]] = collections.defaultdict(list)
    for by_rank in by_collective.values():
        if len(by_rank) > 1:
            middle = statistics.median(by_rank.values())
            for rank, end in by_rank.items():
                deltas[rank].append(end - middle)
    offsets = {rank: int(statistics.median(values)) for rank, values in deltas.items()}
    return {rank: offset for rank, offset in offsets.items() if abs(offset) >= CLOCK_SPREAD_NS}


CLOCK_SPREAD_NS = 1_000_000
"""Offsets under this are left at 0: the spread of a collective's ends (its ranks on one host share a clock)."""


def _collective_ends(spans: list[tuple[dict, dict]]) -> Iterator[tuple[int, str, int, int]]:
    """``clock_offsets``' input: the completed collectives (not point-to-point) of ``spans``."""
    for span, a in spans:
        if names.RANK in a and names.SEQ in a and not a.get(names.P2P) and not a.get(names.IN_FLIGHT):
            with contextlib.suppress(KeyError, TypeError, ValueError):
                yield int(a[names.RANK]), str(a[names.PG_NAME]), int(a[names.SEQ]), int(span["endTimeUnixNano"])


class _TimeInCollectives:
    """After the fact, each rank's ``waited_s`` per group, as live: the seconds per second it spent in
    the group's ops (collectives and point-to-point), over its time from the end of its first op (the
    job's start-up, which ranks reach at their own pace: the first to come waits for the last) to the end
    of its last; and ``waited_at_end_s``, over its last ``END_WINDOW_S``. Spans are sampled: each kind's
    mean duration over the spans kept, times the ops of that kind it issued (sequence numbers) over that
    time."""

    def __init__(self) -> None:
        self.ops: dict[tuple[int, str, bool], list[tuple[int, int, int]]] = collections.defaultdict(list)
        """(rank, group, point-to-point) -> (start, end, seq) of each completed op kept."""
        self.first: dict[int, tuple[int, int, tuple[int, str, bool], int]] = {}
        """rank -> (start, end, its ``ops`` key, seq) of its first op kept."""
        self.last: dict[int, int] = {}
        """rank -> its last op's end (ns)."""

    def add(self, span: dict, a: dict) -> None:
        if names.RANK not in a or names.SEQ not in a or a.get(names.IN_FLIGHT):
            return
        rank, start, end = int(a[names.RANK]), int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
        key, seq = (rank, str(a[names.PG_NAME]), bool(a.get(names.P2P))), int(a[names.SEQ])
        self.ops[key].append((start, end, seq))
        if rank not in self.first or start < self.first[rank][0]:
            self.first[rank] = (start, end, key, seq)
        self.last[rank] = max(self.last.get(rank, end), end)

    def settle(self, ranks: dict[int, RankFacts]) -> None:
        window = int(END_WINDOW_S * 1e9)
        for key, kept in self.ops.items():
            rank, pg, _ = key
            _, first, first_key, first_seq = self.first[rank]
            last = self.last[rank]
            if key == first_key:
                kept = [op for op in kept if op[2] != first_seq]
            if last <= first or rank not in ranks:
                continue
            group = ranks[rank].group(pg)
            before = first_seq if key == first_key else 0
            group.waited_s = (group.waited_s or 0.0) + _per_second(kept, before, (last - first) / 1e9)
            if last - first >= 2 * window:
                since = last - window
                before = max((seq for start, _, seq in kept if start < since), default=before)
                at_end = _per_second([op for op in kept if op[0] >= since], before, END_WINDOW_S)
                group.waited_at_end_s = (group.waited_at_end_s or 0.0) + at_end


def _per_second(kept: list[tuple[int, int, int]], before: int, seconds: float) -> float:
    """Seconds per second in ops over ``seconds``: the mean duration of the ``kept`` (start, end, seq),
    times the ops issued after sequence number ``before`` (the last kept's)."""
    if not kept:
        return 0.0
    mean = sum(end - start for start, end, _ in kept) / len(kept) / 1e9
    return mean * (max(seq for _, _, seq in kept) - before) / seconds


def _rank_of(attributes: dict) -> int | None:
    with contextlib.suppress(KeyError, TypeError, ValueError):
        return int(attributes[names.RANK])
    return None


def _on_the_jobs_clock(span: dict, offset: int) -> dict:
    """``span`` with ``offset`` (its rank's clock's) taken from its times."""
    if not offset:
        return span
    with contextlib.suppress(KeyError, TypeError, ValueError):
        return {**span, "startTimeUnixNano": str(int(span["startTimeUnixNano"]) - offset),
                "endTimeUnixNano": str(int(span["endTimeUnixNano"]) - offset)}
    return span


def attempts_in(folder: str) -> list[tuple[int, str]]:
    """The attempts of the job whose folder this is, with each one's folder: the first in ``folder``
    itself, each elastic restart's in its ``attempt-N`` (``commlens.ring.dumps.ATTEMPT_FOLDER``), in order."""
    pattern = re.compile(re.escape(ATTEMPT_FOLDER).replace(r"\{attempt\}", r"([1-9][0-9]*)") + "$")
    later = sorted((int(m.group(1)), os.path.join(folder, name)) for name in os.listdir(folder)
                   if (m := pattern.match(name)) and os.path.isdir(os.path.join(folder, name)))
    return [(0, folder), *later]


def spans_in(folder: str, on_problem: Callable[[str], None] = say_skipped) -> Iterator[tuple[dict, dict]]:
    """Every span of the OTLP JSON-lines trace files (``*.jsonl``) in ``folder``, with its attributes;
    a line that is not OTLP JSON is skipped, and ``on_problem`` gets one line naming it."""
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        try:
            f = open(path, "rb")  # json.loads decodes each line: one not UTF-8 is named, not the file's end
        except OSError as error:
            on_problem(f"{path}: cannot be read ({error.strerror})")
            continue
        with f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    spans = [(span, {item["key"]: _value(item) for item in span.get("attributes", ())})
                             for resource_spans in json.loads(line).get("resourceSpans", ())
                             for scope_spans in resource_spans.get("scopeSpans", ())
                             for span in scope_spans.get("spans", ())]
                except (AttributeError, KeyError, TypeError, ValueError) as error:
                    on_problem(f"{path}, line {number}: not an OTLP JSON line of spans ({type(error).__name__}: "
                               f"{str(error)[:100]})")
                    continue
                yield from spans


def _value(attribute: dict):
    value = attribute["value"]
    for key in ("intValue", "doubleValue", "boolValue", "stringValue"):
        if key in value:
            return int(value[key]) if key == "intValue" else value[key]
    return None


def _p2p_span_fact(ranks: dict[int, RankFacts], span: dict, a: dict) -> None:
    """A point-to-point op that failed, or that it waited in long or past the hang threshold: on whom,
    and when."""
    failed = a.get(names.STATUS) in ("error", "timeout") and names.PEER in a
    waited = bool(a.get(names.SLOW) or a.get(names.HANG))
    if not (waited or failed):
        return
    facts = ranks.setdefault(int(a[names.RANK]), RankFacts(int(a[names.RANK])))
    start, end = int(span["startTimeUnixNano"]), None if a.get(names.IN_FLIGHT) else int(span["endTimeUnixNano"])
    group = facts.group(str(a[names.PG_NAME]))
    if failed and (group.p2p_failed is None or start < (group.p2p_failed[2] or start + 1)):
        group.p2p_failed = (a[names.OP], int(a[names.PEER]), start)
    if not waited:
        return
    _waited(facts, start, end)
    if names.PEER not in a:
        return
    op, peer = a[names.OP], int(a[names.PEER])
    if not a.get(names.HANG):
        if end is not None and not failed:
            group.p2p_slow_waits.append((start, end, op, peer))
        return
    group.p2p_waits_seen = [w for w in group.p2p_waits_seen if w[0] != start]  # its end replaces its in-flight span
    group.p2p_waits_seen.append((start, end, op, peer))


def _waited(facts: RankFacts, start: int, end: int | None) -> None:
    """A wait of the rank's: the span of its end replaces the one it had in flight, whichever is read first."""
    if end is not None or start not in facts.waits:
        facts.waits[start] = end


def _entry_fact(ranks: dict[int, RankFacts], a: dict) -> None:
    """A span of an input that held NaN or Inf, outside steps a loss scaler skipped: the rank's first of
    all (``names.NONFINITE_ENTRY``, with where it had come to in its groups), or the first send to its
    peer (``names.SEND_NUMBER``)."""
    kind = "nan" if a.get(names.NAN) else "inf"
    facts = ranks.setdefault(int(a[names.RANK]), RankFacts(int(a[names.RANK])))
    pg = str(a[names.PG_NAME])
    if names.SEND_NUMBER in a:
        number = int(a[names.SEND_NUMBER])
        if number < facts.group(pg).first_sends.get(int(a[names.PEER]), (number + 1,))[0]:
            facts.group(pg).first_sends[int(a[names.PEER])] = (number, kind)
    if names.NONFINITE_ENTRY in a:
        where = json.loads(a[names.NONFINITE_ENTRY])
        facts.entry = (pg, a[names.OP], int(a[names.SEQ]), kind, int(a.get(names.PEER, -1)) if a.get(names.P2P) else -1)
        facts.issued_before = {str(group): int(seq) for group, seq in where["issued"].items()}
        facts.received_before = {(str(group), int(peer)): int(n) for group, peers in where["received"].items()
                                 for peer, n in peers.items()}


def _span_fact(ranks: dict[int, RankFacts], span: dict, a: dict, completed: set[tuple[int, str, int]]) -> None:
    if names.RANK not in a:
        return
    facts = ranks.setdefault(int(a[names.RANK]), RankFacts(int(a[names.RANK])))
    began = int(span["startTimeUnixNano"])
    facts.started_ns = began if facts.started_ns is None else min(facts.started_ns, began)
    if (a.get(names.NAN) or a.get(names.INF)) and not a.get(names.LOSS_SCALE_SKIPPED):
        _entry_fact(ranks, a)
    if a.get(names.P2P):
        _p2p_span_fact(ranks, span, a)
        return
    rank, seq, op, pg = int(a[names.RANK]), int(a[names.SEQ]), a[names.OP], str(a[names.PG_NAME])
    group = ranks.setdefault(rank, RankFacts(rank)).group(pg)
    if not a.get(names.IN_FLIGHT):
        completed.add((rank, pg, seq))
        if a.get(names.STATUS) in ("error", "timeout") and (group.failed is None or seq < group.failed[1]):
            group.failed = (op, seq)
    start, end = int(span["startTimeUnixNano"]), None if a.get(names.IN_FLIGHT) else int(span["endTimeUnixNano"])
    group.arrivals[seq] = (op, start)
    group.issued = max(group.issued, seq)
    if names.FINGERPRINT in a:
        group.fingerprints[seq] = (op, int(a[names.FINGERPRINT]))
    if names.DDP_BUCKET in a:  # its spans tell each jump of its buckets' scale (those that jumped are kept)
        group.scale_jumps = group.scale_jumps or {}
        if names.INPUT_SCALE_JUMP in a:
            group.scale_jumps[seq] = (int(a[names.INPUT_SCALE_JUMP_AT_STEP]), int(a[names.INPUT_SCALE_JUMP]), start / 1e9)
    if a.get(names.SLOW) or a.get(names.HANG):
        _waited(ranks[rank], start, end)
        if not a.get(names.HANG) and end is not None:
            group.slow_waits[seq] = (op, start, end)
    if a.get(names.HANG):
        if seq not in group.hangs_seen or end is not None:  # the span of its end, once there is one
            group.hangs_seen[seq] = (start, end)
        if end is None:
            group.hung = (op, seq)
            age = float(a.get(names.AGE_S, 0.0))
            group.threshold_s = age if group.threshold_s is None else min(group.threshold_s, age)
    if a.get(names.LOSS_SCALE_SKIPPED):  # the loss scaler's overflow, in a step it skipped: no fault
        facts = ranks[rank]
        facts.loss_scale_skipped = max(facts.loss_scale_skipped, int(a[names.LOSS_SCALE_SKIPPED]))
        return
    for kind, attribute in (("nan", names.NAN), ("inf", names.INF)):
        if a.get(attribute) and (group.nonfinite is None or seq < group.nonfinite[0]):
            group.nonfinite = (seq, op, kind)


def _collectives(path: str, entries: list) -> list[tuple[str, int, str, str, bool]]:
    """(group, seq, op, inputs, completed) of each collective entry of a dump's (point-to-point ones left
    out); ValueError naming ``path`` and the entry for one of another shape."""
    found = []
    for number, entry in enumerate(entries):
        try:
            if entry.get("is_p2p"):
                continue
            tensors = zip(entry.get("input_dtypes") or (), entry.get("input_sizes") or ())
            found.append((str(entry["process_group"][0]), int(entry["collective_seq_id"]),
                          str(entry.get("profiling_name", "")).rpartition(":")[2],
                          ", ".join(f"{dtype}{list(size)}" for dtype, size in tensors),
                          entry.get("state") == "completed"))
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path} is not a flight-recorder dump: entry {number} is not a collective's "
                             f"({type(error).__name__}: {str(error)[:100]})") from None
    return found


def _dump_fact(facts: RankFacts, dump: dict, collectives: list[tuple[str, int, str, str, bool]]) -> None:
    if isinstance(dump.get(DUMP_SIGNALLED), int):
        facts.signalled_ns = dump[DUMP_SIGNALLED]
    if isinstance(dump.get(DUMP_REASONS), list):  # the pod sidecar's dump of a rank whose process was killed
        facts.lost = lost(set(map(str, dump[DUMP_REASONS])))
    for pg, seq, op, inputs, completed in collectives:
        group = facts.group(pg)
        group.issued = max(group.issued, seq)
        group.inputs[seq] = (op, inputs)
        if facts.lost or facts.signalled_ns is not None:  # its ring at its death or when told to stop
            group.finished = max(group.finished or 0, seq if completed else 0)
