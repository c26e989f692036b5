"""Snapshots on the way down (SIGTERM, an unhandled exception), and sampling that agrees across ranks."""

import collections
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.trace.export import SpanExportResult

from commlens.agent.sidecar import Sidecar
from commlens.exporters.otlp import BatchSpanProcessor
from commlens.hooks import record
from commlens.ring import codec
from commlens.ring.layout import ERROR, NAN_HAS_NAN, OK
from commlens.ring.memory import Ring

from ports import free_port

CHILDREN = pathlib.Path(__file__).resolve().parent / "children"

@pytest.mark.parametrize("ending", ["sigterm", "exception"])
def test_the_process_leaves_a_dump_and_ends_as_it_would_have(tmp_path, ending):
    env = {**os.environ, "TORCHCOMM_FR_DUMP_TEMP_FILE": str(tmp_path / "rank_"), "COMMLENS_METRICS_PORT": "0",
           "COMMLENS_TRACE_FILE": str(tmp_path / "spans.jsonl")}
    job = subprocess.Popen([sys.executable, str(CHILDREN / "snapshot_job.py"), ending, str(free_port())], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert job.stdout.readline() == "trained\n"
    if ending == "sigterm":
        job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    if ending == "sigterm":
        assert job.returncode == -signal.SIGTERM  # the default handler's ending, after the snapshot
    else:
        assert job.returncode == 1 and "RuntimeError: the training loop broke" in err
    dump = pickle.loads((tmp_path / "rank_0").read_bytes())
    assert [e["profiling_name"] for e in dump["entries"]] == ["gloo:all_reduce"] * 3
    assert (tmp_path / "spans.jsonl").read_text().count('"name":"all_reduce"') == 3  # pending spans flushed


class _Nowhere:
    form = "protobuf"

    def export(self, request, within_s):
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


def _kept(spans: BatchSpanProcessor, seqs) -> set[int]:
    """The seqs of group "0"'s ordinary collectives that ``spans`` keeps."""
    seqs = list(seqs)
    return {seqs[k] for k in spans.sampled("0", seqs, False)}


def test_sampling_keeps_or_drops_a_collective_on_every_rank_together():
    ranks = [BatchSpanProcessor(_Nowhere(), {"commlens.rank": r}, job="job-7", sampler_ratio=0.3) for r in range(4)]
    decisions = [_kept(exporter, range(1, 2001)) for exporter in ranks]
    assert all(d == decisions[0] for d in decisions)  # every rank decides the same, without talking
    assert 0.25 < len(decisions[0]) / 2000 < 0.35
    off = BatchSpanProcessor(_Nowhere(), {}, job="job-7", sample_none=True)
    assert not _kept(off, [1]) and off.counts["sampled_out"] == 1
    for exporter in (*ranks, off):
        exporter.shutdown(5)


def test_the_span_budget_bounds_spans_per_second_whatever_the_rate_and_ranks_keep_the_same_collectives():
    budget = 50
    ranks = [BatchSpanProcessor(_Nowhere(), {"commlens.rank": r}, job="job-7", budget_per_s=budget) for r in range(2)]
    kept: list[list[tuple[float, int]]] = [[], []]
    windows: list[collections.Counter] = [collections.Counter(), collections.Counter()]
    started = time.monotonic()
    seq = 0
    while time.monotonic() - started < 3.5:  # the workload: a job issuing collectives as fast as it can
        seq += 1
        for rank, exporter in enumerate(ranks):
            if _kept(exporter, [seq]):
                kept[rank].append((time.monotonic() - started, seq))
                windows[rank][exporter._window_start] += 1  # the second it was kept in, as the exporter counts
    assert seq > 20 * budget  # far over the budget
    for found, per_window in zip(kept, windows):
        assert len(per_window) >= 3 and max(per_window.values()) <= budget, per_window
        assert len(found) >= budget  # it does keep spans, up to the budget
    later = [{s for t, s in found if t >= 1.1} for found in kept]  # once each rank has seen the rate
    assert len(later[0] & later[1]) >= 0.8 * max(len(later[0]), len(later[1])), later
    for exporter in ranks:
        exporter.shutdown(5)


class _Kept:
    form = "protobuf"

    def __init__(self):
        self.names = []

    def export(self, request, within_s):
        self.names += [(s.name, s.status.code) for rs in request.resource_spans for ss in rs.scope_spans
                       for s in ss.spans]
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


def test_the_sidecar_builds_only_the_collectives_the_sampler_keeps_and_every_anomaly():
    exporter = _Kept()
    spans = BatchSpanProcessor(exporter, {}, job="job-7", sampler_ratio=0.25)
    reference = BatchSpanProcessor(_Nowhere(), {}, job="job-7", sampler_ratio=0.25)
    sampled = _kept(reference, range(1, 201))
    failed, nonfinite = [seq for seq in range(1, 201) if seq not in sampled][:2]  # anomalies the sampler would drop
    ring = Ring(slots=1024)
    sidecar = Sidecar(ring, rank=0, hang_threshold_s=60, on_collective=spans.queue, sample=spans.sampled)
    group = ring.intern(codec.encode_group("0", "default_pg", [0, 1], 0, "gloo"))
    for seq in range(1, 201):  # collectives of 100 µs, one a millisecond: none slow
        record.start(ring.write, 0, group, seq, seq, 64, 0, -1, t_ns=seq * 1_000_000)
        if seq == nonfinite:
            record.nan(ring.write, 0, group, seq, seq, 0, -1, 0, NAN_HAS_NAN, 1)
        record.end(ring.write, 0, group, seq, seq, 64, 0, -1, status=ERROR if seq == failed else OK,
                   t_ns=seq * 1_000_000 + 100_000)
    sidecar.drain()
    spans.shutdown(5)
    reference.shutdown(5)
    counts = dict(spans.counts)
    expected = len(sampled) + 2
    assert len(exporter.names) == expected and 30 < expected < 70, exporter.names
    assert exporter.names.count(("all_reduce", 2)) == 2  # the failed and the NaN one, errors whatever their trace id
    assert counts == {"sampled_out": 200 - expected, "exported": expected}, counts
    assert sum(sidecar.stats.completed.values()) == 200  # every collective in the metrics


def test_past_the_first_non_finite_collectives_of_a_group_they_are_sampled_and_every_one_counted():
    """A diverged job: every collective holds NaN. The first ``NAN_SPANS_KEPT`` of the group are exported
    whatever the sampling (where the values entered); the others as the sampler keeps any collective."""
    from commlens.agent.join import NAN_SPANS_KEPT

    exporter = _Kept()
    spans = BatchSpanProcessor(exporter, {}, job="job-8", sampler_ratio=0.25)
    reference = BatchSpanProcessor(_Nowhere(), {}, job="job-8", sampler_ratio=0.25)
    total = 3 * NAN_SPANS_KEPT
    sampled = _kept(reference, range(NAN_SPANS_KEPT + 1, total + 1))
    ring = Ring(slots=4096)
    sidecar = Sidecar(ring, rank=0, hang_threshold_s=60, on_collective=spans.queue, sample=spans.sampled)
    group = ring.intern(codec.encode_group("0", "default_pg", [0, 1], 0, "gloo"))
    for seq in range(1, total + 1):
        record.start(ring.write, 0, group, seq, seq, 64, 0, -1, t_ns=seq * 1_000_000)
        record.nan(ring.write, 0, group, seq, seq, 0, -1, 0, NAN_HAS_NAN, 1)
        record.end(ring.write, 0, group, seq, seq, 64, 0, -1, t_ns=seq * 1_000_000 + 100_000)
    sidecar.drain()
    spans.shutdown(5)
    reference.shutdown(5)
    assert len(exporter.names) == NAN_SPANS_KEPT + len(sampled) and 0 < len(sampled) < total - NAN_SPANS_KEPT
    assert sidecar.stats.nans == {("all_reduce", "0", "nan"): total}  # every one counted
    assert sidecar.stats.first_nonfinite == {("0", "nan"): (1, "all_reduce")}


def test_a_slow_outlier_is_judged_against_its_own_op_and_size_at_the_default_detail_level():
    from commlens.ring.ops import CODE, OpName

    slow = []
    ring = Ring(slots=1024)
    sidecar = Sidecar(ring, rank=0, hang_threshold_s=60, detail="group",
                      on_collective=lambda c: slow.append((c.op, c.seq)) if c.slow else None)
    group = ring.intern(codec.encode_group("0", "default_pg", [0, 1], 0, "gloo"))
    small, large = CODE[OpName.all_reduce], CODE[OpName.all_gather_into_tensor]
    timeline = [(small, 256, 100_000)] * 40 + [(large, 1 << 30, 50_000_000)] * 3 + [(small, 256, 2_000_000)]
    t = 0
    for seq, (op, nbytes, duration_ns) in enumerate(timeline, 1):
        record.start(ring.write, op, group, seq, seq, nbytes, 0, -1, t_ns=t)
        record.end(ring.write, op, group, seq, seq, nbytes, 0, -1, t_ns=t + duration_ns)
        t += duration_ns + 1_000_000
    sidecar.drain()
    # the large all_gathers are as fast as such all_gathers go; the small all_reduce 20x its usual time is slow
    assert slow == [("all_reduce", len(timeline))]


@pytest.mark.parametrize("order", ["nan-first", "start-first"])
def test_a_ranks_first_non_finite_input_carries_what_it_had_issued_before_it_even_where_a_read_folds_those(order):
    """Rank 3's ring, drained at once (its collectives folded, handed over after the rest): 30 all_reduces
    of its pair (group 1), 4 recvs from rank 5 and 2 sends to it (group 6), then an all_reduce whose input
    held NaN (its entry), then a send to rank 5 whose input held it (its 3rd to rank 5), then another
    all_reduce with NaN, still in flight (its START handed over before the folded ones). The entry says
    what had been issued before it; the send its number; both on their spans. A NAN record before or
    after its START alike."""
    from commlens.ring.ops import CODE, OpName

    ring, seen = Ring(slots=4096), []
    sidecar = Sidecar(ring, rank=3, hang_threshold_s=60, on_collective=seen.append)
    pair = ring.intern(codec.encode_group("1", "tp", [2, 3], 1, "gloo"))
    stage = ring.intern(codec.encode_group("6", "pp", [3, 5], 0, "gloo"))
    op_ids = iter(range(1, 1000))

    def issue(op, group, seq, peer=-1, nan=False, ends=True):
        op_id, code = next(op_ids), CODE[op]
        if nan and order == "nan-first":
            record.nan(ring.write, code, group, op_id, seq, 0, peer, 0, NAN_HAS_NAN, 1)
        record.start(ring.write, code, group, op_id, seq, 64, 0, peer, t_ns=op_id * 1_000_000)
        if nan and order == "start-first":
            record.nan(ring.write, code, group, op_id, seq, 0, peer, 0, NAN_HAS_NAN, 1)
        if ends:
            record.end(ring.write, code, group, op_id, seq, 64, 0, peer, t_ns=op_id * 1_000_000 + 100_000)

    for seq in range(1, 31):
        issue(OpName.all_reduce, pair, seq)
    for seq in range(1, 5):
        issue(OpName.recv, stage, seq, peer=1)
    for seq in range(5, 7):
        issue(OpName.send, stage, seq, peer=1)
    issue(OpName.all_reduce, pair, 31, nan=True)
    issue(OpName.send, stage, 7, peer=1, nan=True)
    issue(OpName.all_reduce, pair, 32, nan=True, ends=False)  # in flight: handed over before the folded ones
    sidecar.drain()
    entry = sidecar.stats.nonfinite_entry
    assert (entry.pg, entry.op, entry.seq, entry.kind, entry.peer) == ("1", "all_reduce", 31, "nan", -1)
    assert entry.issued == {"1": 30} and entry.received == {("6", 5): 4}
    assert sidecar.stats.first_send == {("6", 5, "nan"): 3}
    marked = {(c.op, c.seq): (c.send_number, c.nonfinite_entry) for c in seen if c.send_number or c.nonfinite_entry}
    assert marked == {("all_reduce", 31): (0, '{"issued":{"1":30},"received":{"6":{"5":4}}}'), ("send", 7): (3, "")}


def test_a_pipeline_stage_whose_scaler_scales_no_loss_counts_the_overflow_it_receives_as_overflow():
    """A first pipeline stage in mixed precision: its GradScaler is made and steps, but scales no loss (its
    gradients come from the stage after it). Its all_reduce's input holds the Inf of an overflow that
    stage sent it, and its scaler skips the step: no values entered. The next step's Inf, in a step it
    applies, did enter (there: its entry)."""
    from commlens.ring.ops import CODE, OpName
    from commlens.ring.layout import NAN_HAS_INF

    ring = Ring(slots=4096)
    sidecar = Sidecar(ring, rank=0, hang_threshold_s=60)
    group = ring.intern(codec.encode_group("9", "dp", [0, 4], 0, "gloo"))
    code = CODE[OpName.all_reduce]
    record.loss_scale(ring.write, "made")
    for seq, outcome in ((1, "skipped"), (2, "applied")):
        record.nan(ring.write, code, group, seq, seq, 0, -1, 0, NAN_HAS_INF, 1)
        record.start(ring.write, code, group, seq, seq, 64, 0, -1)
        record.end(ring.write, code, group, seq, seq, 64, 0, -1)
        record.loss_scale(ring.write, outcome)
        sidecar.drain()
        entry = sidecar.stats.nonfinite_entry
        assert (entry.seq if entry else None) == (None if outcome == "skipped" else 2), outcome
    assert sidecar.stats.first_nonfinite == {("9", "inf"): (2, "all_reduce")}
