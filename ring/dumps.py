"""Flight-recorder dumps of a ring's records, in PyTorch's schema (``torchfrtrace DIR`` reads a folder of
them), and their files: the last collectives of any ring, this process's or another's attached (the pod
sidecar's dumps of a killed or frozen rank). Imports no torch.

Example::

    dump = dump_ring(Ring.attach(path), max_entries=1024)
    write_dump(dump, rank=3)                  # $TORCHCOMM_FR_DUMP_TEMP_FILE3, whole or not at all
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
import time

from .codec import GroupDescription, decode_group, decode_signature
from .layout import END, NOT_ISSUED, START, STATUS, Record
from .memory import Ring
from .ops import OPS, OpName

DUMP_SIGNALLED = "commlens_signalled_ns"
"""One of commlens' keys beside PyTorch's schema (its analyzer does not read them): the wall-clock time
(ns) at which the writer's process was signalled to stop (SIGTERM), in every dump written from then on.
``commlens diagnose`` reads it: the waits the stop causes are no fault."""
DUMP_REASONS = "commlens_reasons"
"""Why this rank's dumps were written, this one's last (``layout.REASONS``): ``commlens diagnose`` tells
from them, after the fact, a rank whose process ended with no signal or exception (``exit``: killed)."""

VERSION = "2.10"
ENDED = "ended-{rank}.json"
"""A rank's note, beside its dumps, that its process ended cleanly (``write_end_note``): ``commlens
diagnose`` tells from its absence, after the fact, a rank killed with no pod sidecar to see it (its
process left no dump and no note)."""

DUMP_PREFIX_ENV = "TORCHCOMM_FR_DUMP_TEMP_FILE"
DEFAULT_DUMP_PREFIX = os.path.join("~", ".cache", "torchcomm_fr_trace_")
ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's count of the job's elastic restarts (``--max-restarts``): the attempt a rank runs in."""
ATTEMPT_FOLDER = "attempt-{attempt}"
"""Where a restarted attempt writes its files: a folder beside the first attempt's, so that no attempt
overwrites another's dumps and spans (its collectives are numbered from 0 again), and each folder
reads as a job's."""
_STACKED_OUTPUTS = {OpName.all_gather, OpName.gather}
_STACKED_INPUTS = {OpName.reduce_scatter, OpName.scatter}
_DEFAULT_TIMEOUT_MS = 30 * 60 * 1000
_UNDESCRIBED = GroupDescription("", "undefined", [], -1, "gloo")
"""A group whose description was lost (its string had no room in the ring's arena)."""


def dump_ring(ring: Ring, max_entries: int = 2048) -> dict:
    """The last ``max_entries`` collectives in ``ring`` (this process's or another's, attached) as a
    dump; the writer's ``torch`` version from its ``describe``d info. Imports no torch."""
    return as_dump(*entries(ring, max_entries), f"torch {ring.info().get('torch', 'unknown')}")


def entries(ring: Ring, max_entries: int, from_op_id: int = 0, until_op_id: int | None = None,
            groups: set[str] | None = None) -> tuple[list[dict], dict, dict]:
    """(entries, pg_config, pg_status) of the last ``max_entries`` collectives in ``ring`` with op ids
    in ``[from_op_id, until_op_id)`` of the groups named in ``groups`` (None: every group)."""
    starts, ends, described = {}, {}, {}
    until = until_op_id if until_op_id is not None else float("inf")
    for record in ring.snapshot():
        if record.kind not in (START, END) or not from_op_id <= record.op_id < until:
            continue
        group = described.get(record.pg)
        if group is None:
            group = described[record.pg] = decode_group(ring.string(record.pg)) or _UNDESCRIBED
        if groups is not None and group.name not in groups:
            continue
        (starts if record.kind == START else ends)[record.op_id] = record
    op_ids = sorted(i for i in starts if i not in ends or ends[i].flags != NOT_ISSUED)[-max_entries:]
    first = op_ids[0] if from_op_id == 0 and op_ids else from_op_id
    found = [_entry(starts[i], ends.get(i), described[starts[i].pg], ring, first) for i in op_ids]
    return found, _pg_config(described), _pg_status(found)


def _entry(start: Record, end: Record | None, group: GroupDescription, ring: Ring, first_op_id: int) -> dict:
    op = OPS[start.op]
    in_sizes, in_dtypes, out_sizes, out_dtypes = decode_signature(ring.string(start.sig))
    if op.is_p2p:  # c10d records a p2p op's one tensor as both input and output
        in_sizes = out_sizes = in_sizes or out_sizes
        in_dtypes = out_dtypes = in_dtypes or out_dtypes
        me = group.own_rank
        arrow = f"{me}->{start.peer}" if op is OpName.send else f"{me}<-{start.peer}"
        name = f"{group.backend}:{op.value} {arrow}"
    else:
        if op in _STACKED_OUTPUTS:
            out_sizes, out_dtypes = _stacked(out_sizes, out_dtypes)
        if op in _STACKED_INPUTS:
            in_sizes, in_dtypes = _stacked(in_sizes, in_dtypes)
        name = f"{group.backend}:{op.fr_name}"
    created = start.t_ns + ring.clock_offset_ns
    completed = end.t_ns + ring.clock_offset_ns if end is not None else None
    return {
        "record_id": start.op_id - first_op_id,
        "pg_id": int(group.name) if group.name.isdigit() else start.pg,
        "process_group": (group.name, group.desc),
        "collective_seq_id": 0 if op.is_p2p else start.seq,
        "p2p_seq_id": start.seq if op.is_p2p else 0,
        "op_id": start.op_id,
        "profiling_name": name,
        "time_created_ns": created,
        "input_sizes": in_sizes,
        "input_dtypes": in_dtypes,
        "output_sizes": out_sizes,
        "output_dtypes": out_dtypes,
        "state": "completed" if end is not None else "started",
        "time_discovered_started_ns": created,
        "time_discovered_completed_ns": completed,
        "duration_ms": (end.t_ns - start.t_ns) / 1e6 if end is not None else None,
        "retired": end is not None,
        "timeout_ms": _DEFAULT_TIMEOUT_MS,
        "is_p2p": op.is_p2p,
        "status": STATUS[end.flags] if end is not None else "in_flight",
        "frames": [],
    }


def as_dump(found: list[dict], pg_config: dict, pg_status: dict, comm_lib_version: str) -> dict:
    """The dump of ``entries``' three parts, written by ``comm_lib_version`` ("torch 2.13.0")."""
    return {"version": VERSION, "comm_lib_version": comm_lib_version, "pg_config": pg_config,
            "pg_status": pg_status, "entries": found}


def attempt_path(path: str, attempt: int) -> str:
    """``path`` for an attempt of the job: itself for the first (0), else in ``ATTEMPT_FOLDER`` beside it.

    >>> attempt_path(os.path.join("out", "rank_"), 2) == os.path.join("out", "attempt-2", "rank_")
    True
    """
    if attempt == 0:
        return path
    head, tail = os.path.split(path)
    return os.path.join(head, ATTEMPT_FOLDER.format(attempt=attempt), tail)


def current_attempt() -> int:
    """This process's attempt (``ATTEMPT_ENV``; 0 outside torchrun). ``Config.from_env`` refuses a
    value that is not a count; here, where a user's code asks for a dump, such a value is attempt 0."""
    value = os.environ.get(ATTEMPT_ENV, "0")
    return int(value) if value.isdigit() else 0


def dump_prefix(attempt: int) -> str:
    """The dumps' prefix (``TORCHCOMM_FR_DUMP_TEMP_FILE``, or torchcomms' default) for ``attempt``."""
    return attempt_path(os.path.expanduser(os.environ.get(DUMP_PREFIX_ENV) or DEFAULT_DUMP_PREFIX), attempt)


def write_dump(dump: dict, rank: int, signalled_ns: int | None = None, reasons: tuple[str, ...] = (),
               attempt: int = 0) -> str:
    """Write ``dump`` as a pickle named ``<prefix><rank>`` (``dump_prefix(attempt)``) and return its
    path. The file appears whole or not at all. ``signalled_ns``: when the writer's process was
    signalled to stop, kept as ``DUMP_SIGNALLED``; ``reasons``: why this rank's dumps were written so
    far, kept as ``DUMP_REASONS``."""
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"dump_file(rank={rank!r}) is not accepted: rank must be an integer >= 0")
    prefix = dump_prefix(attempt)
    path = f"{prefix}{rank}"
    ours = {**({DUMP_SIGNALLED: signalled_ns} if signalled_ns is not None else {}),
            **({DUMP_REASONS: list(reasons)} if reasons else {})}
    data = pickle.dumps({**dump, **ours} if ours else dump)
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".commlens-dump-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as error:
        raise OSError(error.errno, f"cannot write the flight-recorder dump {path!r} "
                      f"(prefix from {DUMP_PREFIX_ENV}={prefix!r}): {error.strerror}; "
                      "the entries are still in the ring, so the dump can be retried") from error
    return path


def write_end_note(rank: int, attempt: int = 0) -> str:
    """Write ``ENDED`` for ``rank`` in the dumps' folder (``dump_prefix(attempt)``'s) and return its
    path: the rank's process ends cleanly (``{"rank": 3, "ended_ns": ...}``)."""
    folder = os.path.dirname(dump_prefix(attempt)) or "."
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, ENDED.format(rank=rank))
    with open(path, "w") as f:
        json.dump({"rank": rank, "ended_ns": time.time_ns()}, f)
    return path


def _stacked(sizes: list, dtypes: list) -> tuple[list, list]:
    if sizes and all(s == sizes[0] for s in sizes):
        return [[len(sizes), *sizes[0]]], dtypes[:1]
    return sizes, dtypes


def _pg_config(groups: dict[int, GroupDescription]) -> dict:
    return {g.name: {"name": g.name, "desc": g.desc, "ranks": str(g.ranks)} for g in groups.values() if g.name}


def _pg_status(entries: list[dict]) -> dict:
    status: dict[str, dict[str, int]] = {}
    for e in entries:
        if e["is_p2p"]:
            continue
        s = status.setdefault(e["process_group"][0], {"last_enqueued_collective": -1,
                                                       "last_started_collective": -1,
                                                       "last_completed_collective": -1})
        seq = e["collective_seq_id"]  # every entry started: enqueued and started are the same
        s["last_enqueued_collective"] = s["last_started_collective"] = max(s["last_enqueued_collective"], seq)
        if e["state"] == "completed":
            s["last_completed_collective"] = max(s["last_completed_collective"], seq)
    return status
