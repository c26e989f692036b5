"""The ring: records in order, exact overwrite counts, threads, another process reading it."""

import itertools
import json
import os
import pathlib
import struct
import subprocess
import sys
import threading
import time
import types

import pytest

from commlens.hooks import END, START, Ring, RingReader
from commlens.ring.layout import GPU_START, LOSS_SCALE, NAN
from commlens.ring.wakeups import WakeFiles

CHILDREN = pathlib.Path(__file__).resolve().parent / "children"


def write(ring, op_id, kind=START):
    # Every field derives from op_id, so a torn or mixed-up record is detectable.
    ring.write(kind, op_id % 14, op_id % 3, op_id % 1000, op_id, op_id * 3, op_id * 7,
               op_id % 2000, -(op_id % 5), op_id % 11, (op_id % 4000) << 8 | op_id % 4, op_id * 5)


def check(record):
    i = record.op_id
    assert (record.op, record.flags, record.pg, record.seq, record.t_ns, record.nbytes, record.sig,
            record.peer, record.aux, record.module, record.phase) == \
        (i % 14, i % 3, i % 1000, i * 3, i * 5, i * 7, i % 2000, -(i % 5), i % 11, i % 4000, i % 4)


def test_reader_gets_records_in_order_and_then_nothing():
    ring = Ring(slots=16)
    reader = RingReader(ring)
    for i in range(10):
        write(ring, i)
    records = reader.read()
    assert [r.op_id for r in records] == list(range(10))
    for r in records:
        check(r)
    assert reader.read() == [] and reader.dropped == 0


def test_a_folded_read_groups_the_collectives_that_ended_ok_by_shape_and_keeps_every_other_record_in_order():
    ring = Ring(slots=64)
    # (op_id, kind, op, status, nbytes, t_ns): 1, 2 and 6 start and end ok (2 and 6 in another shape
    # than 1, 6 in yet another); 3 fails, 4 lost its START, 5 is still in flight, 7's output held a NaN; 9 ran
    # on a GPU (a group of its own), 10 failed there, 11 started before this read
    for op_id, kind, op, status, nbytes, t_ns in [
            (1, START, 2, 0, 64, 100), (2, START, 2, 0, 128, 200), (3, START, 2, 0, 64, 300), (7, NAN, 2, 2, 64, 310),
            (7, START, 2, 0, 64, 320), (1, END, 2, 0, 64, 1100), (4, END, 2, 0, 64, 1200), (3, END, 2, 1, 64, 1300),
            (5, START, 2, 0, 64, 1400), (6, START, 3, 0, 64, 1450), (2, END, 2, 0, 128, 1500),
            (7, END, 2, 0, 64, 1600), (6, END, 3, 0, 64, 1700), (8, START, 2, 0, 64, 1800), (8, END, 2, 0, 64, 2300),
            (9, START, 2, 0, 64, 2400), (10, START, 2, 0, 64, 2410), (11, GPU_START, 2, 0, 64, 2420),
            (11, END, 2, 0, 64, 2430), (9, GPU_START, 2, 0, 64, 2650), (9, END, 2, 0, 64, 2900),
            (10, GPU_START, 2, 0, 64, 2910), (10, END, 2, 1, 64, 2920)]:
        ring.write(kind, op, status if kind == END else 1, 9, op_id, op_id * 10, nbytes, 7, -1, op_id + 100,
                   (33 << 8) | 3 if kind == START else 0, t_ns)
    records = RingReader(ring).read()
    rest, groups = RingReader(ring).read_folded()
    assert [(r.kind, r.op_id) for r in rest] == [
        (START, 3), (NAN, 7), (START, 7), (END, 4), (END, 3), (START, 5), (END, 7), (START, 10), (GPU_START, 11),
        (END, 11), (GPU_START, 10), (END, 10)]
    assert rest == [r for r in records if r.op_id in (3, 4, 5, 7, 10, 11)]
    assert [(g.op, g.nbytes, list(g.seqs()), list(g.seconds()), [list(v) for v in g.gpu_seconds()])
            for g in groups] == [
        (2, 64, [10, 80], [1e-6, 5e-7], [[], []]), (2, 128, [20], [1.3e-6], [[], []]),
        (3, 64, [60], [2.5e-7], [[], []]), (2, 64, [90], [5e-7], [[2.5e-7], [2.5e-7]])]
    for group in groups:
        for k, seq in enumerate(group.seqs()):
            assert group.records(k) == tuple(r for r in records if r.seq == seq)
    assert len(rest) + sum(group.record_count() for group in groups) == len(records)


@pytest.mark.parametrize("run, folded", [
    ([(NAN, 2), (START, 0), (END, 0)], True),
    ([(START, 0), (NAN, 2), (END, 0)], False),  # a NAN after its START: left to the reader, in order
    ([(NAN, 1), (START, 0), (END, 0)], False),  # an output's
    ([(NAN, 2), (START, 0), (END, 0), (LOSS_SCALE, 2)], False),  # a loss scaler's step ends in the same read
], ids=["input-before-start", "after-start", "output", "loss-scale-in-the-read"])
def test_a_collective_with_its_inputs_nan_record_is_folded_only_where_its_order_holds(run, folded):
    ring = Ring(slots=64)
    for op_id in (1, 2):  # a NaN collective, and a finite one (always folded)
        for kind, flags in run if op_id == 1 else [(START, 0), (END, 0)]:
            ring.write(kind, 2, flags, 9, 0 if kind == LOSS_SCALE else op_id, op_id, 64, 7, -1, 0, 0,
                       100 * op_id + len(ring.snapshot()))
    rest, groups = RingReader(ring).read_folded()
    assert [g.nan for g in groups] == ([2, 0] if folded else [0])
    assert {r.op_id for r in rest if r.kind != LOSS_SCALE} == (set() if folded else {1})


def test_the_sidecar_counts_a_gpus_collectives_alike_whether_they_end_within_one_drain_or_across_two():
    from commlens.agent.sidecar import Sidecar

    def drained(across: bool) -> tuple:
        ring, seen = Ring(slots=256), []
        sidecar = Sidecar(ring, rank=0, hang_threshold_s=60, on_collective=seen.append)
        pg = ring.intern(json.dumps({"name": "0", "desc": "default", "ranks": [0, 1], "rank": 0, "backend": "nccl"}))
        sig = ring.intern(json.dumps([[[16]], ["Float"], [[16]], ["Float"]]))
        now = time.monotonic_ns()  # the hang watchdog's clock
        for op_id in range(1, 41):  # the GPU starts each 1-40 µs after issue, runs it 50 µs; one clock skew
            t = now + op_id * 1_000_000
            ring.write(START, 2, 0, pg, op_id, op_id, 64, sig, -1, 0, 0, t)
            if across:
                sidecar.drain()
            gpu = t - 500 if op_id == 7 else t + op_id * 1000  # 7: the GPU's clock a little behind
            ring.write(GPU_START, 2, 0, pg, op_id, op_id, 64, sig, -1, 0, 0, gpu)
            ring.write(END, 2, 0, pg, op_id, op_id, 64, sig, -1, 0, 0, gpu + 50_000)
        sidecar.drain()
        stats = sidecar.stats
        return (dict(stats.completed), stats.gpu_queue, stats.gpu_exec, seen,
                stats.durations[next(iter(stats.durations))].count)

    within, across = drained(False), drained(True)
    assert within[0] == across[0] and within[4] == across[4] == 40
    for folded, one_by_one in zip(within[1:3], across[1:3]):
        assert folded.keys() == one_by_one.keys() and all(
            folded[key] == pytest.approx(one_by_one[key], rel=1e-12) for key in folded)
    assert sum(within[1].values()) == pytest.approx(sum(k * 1e-6 for k in range(1, 41) if k != 7))
    spans = [[(c.seq, c.gpu_start_ns - c.start_ns, c.end_ns - c.start_ns) for c in seen] for seen in (within[3], across[3])]
    assert spans[0] == spans[1] and len(spans[0]) == 40 and spans[0][6] == (7, 0, 49_500)  # 7: clamped to its issue


@pytest.mark.parametrize("scaled", [False, True], ids=["diverged", "loss-scaler-skips-the-step"])
def test_the_sidecar_counts_non_finite_collectives_alike_whether_they_end_within_one_drain_or_across_two(scaled):
    """An overflow storm: 150 all_reduces whose inputs held Inf (their NAN record before START, as the
    NaN check writes it), drained after the 50th and at the end (most of them folded with their NAN
    records), or record by record. The same counts, the same first non-finite sequence number (none in a
    step a loss scaler skipped: its overflow), and the spans of the group's first ``NAN_SPANS_KEPT``
    kept, none offered to the sampler."""
    from commlens.agent.join import NAN_SPANS_KEPT
    from commlens.agent.sidecar import Sidecar
    from commlens.hooks import record
    from commlens.ring.ops import CODE, OpName
    from commlens.ring.layout import NAN_HAS_INF

    def drained(across: bool) -> tuple:
        ring, seen, offered, folded = Ring(slots=1024), [], [], []
        sidecar = Sidecar(ring, rank=0, hang_threshold_s=60, on_collective=seen.append,
                          sample=lambda pg, seqs, is_p2p: offered.extend(seqs) or [])  # only the NaN rule keeps
        read_folded = sidecar.reader.read_folded

        def reading(limit):
            rest, groups = read_folded(limit)
            folded.extend(len(group.seqs()) for group in groups if group.nan)
            return rest, groups

        sidecar.reader.read_folded = reading
        pg = ring.intern(json.dumps({"name": "0", "desc": "default", "ranks": [0, 1], "rank": 0, "backend": "gloo"}))
        sig = ring.intern(json.dumps([[[16]], ["Float"], [[16]], ["Float"]]))
        if scaled:
            record.loss_scale(ring.write, "scaled")
            sidecar.drain()
        now, op = time.monotonic_ns(), CODE[OpName.all_reduce]
        for op_id in range(1, 151):
            t = now + op_id * 1_000_000
            ring.write(NAN, op, NAN_HAS_INF, pg, op_id, op_id, 1, sig, -1, 0, 0, t)
            ring.write(START, op, 0, pg, op_id, op_id, 64, sig, -1, 0, 0, t)
            if across or op_id == 50:
                sidecar.drain()
            ring.write(END, op, 0, pg, op_id, op_id, 64, sig, -1, 0, 0, t + 50_000)
        sidecar.drain()
        if scaled:
            record.loss_scale(ring.write, "skipped")
            sidecar.drain()
        stats = sidecar.stats
        return (dict(stats.nans), dict(stats.first_nonfinite), sorted(c.seq for c in seen), offered,
                dict(stats.loss_scale_steps)), sum(folded)

    (within, folded), (across, _) = drained(False), drained(True)
    assert within == across and folded > 50
    nans, first, spans, offered, steps = within
    assert sum(nans.values()) == 150 and spans == list(range(1, NAN_SPANS_KEPT + 1))
    assert first == ({} if scaled else {("0", "inf"): (1, "all_reduce")}) and steps == ({"skipped": 1} if scaled else {})
    assert not set(offered) & set(spans)



def busy_job_under_a_long_drain_interval(rank, world_size):
    import torch
    import torch.distributed as dist

    import commlens.agent
    from commlens.agent import Config

    agent = commlens.agent.start(Config.from_env({
        "RANK": "0", "WORLD_SIZE": "1", "COMMLENS_METRICS_PORT": "0", "COMMLENS_TRACE_FILE": os.devnull,
        "COMMLENS_RING_SLOTS": "4096", "COMMLENS_DRAIN_INTERVAL_MS": "1000"}))
    t = torch.ones(4)
    for _ in range(20_000):  # 40,000 records in well under the second between timed drains
        dist.all_reduce(t)
    commlens.agent.stop()
    return {"dropped": agent.sidecar.reader.dropped, "completed": sum(agent.sidecar.stats.completed.values())}


def test_a_busy_job_loses_no_record_although_its_sidecar_drains_only_once_a_second(run_ranks):
    [r] = run_ranks(busy_job_under_a_long_drain_interval, 1)
    assert r == {"dropped": 0, "completed": 20_000}  # the ring woke its reader each quarter it filled


def test_a_sidecar_starved_of_the_gil_catches_up_before_the_ring_laps_it(monkeypatch):
    """The mechanism behind a busy job's lost records on a loaded machine: each time the drain hands
    the GIL over, training keeps it for a whole switch interval (5 ms) and writes meanwhile. Here
    each hand-over lets training write 256 records, four times what the drain reads between two."""
    from commlens.agent import sidecar as module

    ring = Ring(slots=4096)
    pg = ring.intern(json.dumps({"name": "0", "desc": "default", "ranks": [0], "rank": 0, "backend": "gloo"}))
    issued = iter(range(1, 20_001))  # the busy job's 20,000 all_reduces

    def training_writes(collectives: int) -> None:
        for op_id in itertools.islice(issued, collectives):
            ring.write(START, 2, 0, pg, op_id, op_id, 64, 0, -1, 0, 0, op_id)
            ring.write(END, 2, 0, pg, op_id, op_id, 64, 0, -1, 0, 0, op_id + 1)

    hand_overs = []
    monkeypatch.setattr(module, "time", types.SimpleNamespace(
        monotonic_ns=time.monotonic_ns, sleep=lambda s: (hand_overs.append(s), training_writes(128))))
    sidecar = module.Sidecar(ring, rank=0, hang_threshold_s=60, beside_training=True)
    training_writes(1024)  # half the ring: the sidecar was woken at a quarter
    sidecar.drain()
    assert next(issued, None) is None  # training ended before the drain
    assert sidecar.reader.dropped == 0 and sum(sidecar.stats.completed.values()) == 20_000
    assert hand_overs  # it did let training in while it had room


def test_overwritten_records_are_counted_exactly():
    ring = Ring(slots=8)
    reader = RingReader(ring)
    for i in range(5):
        write(ring, i)
    assert len(reader.read()) == 5
    for i in range(5, 5 + 27):  # 27 new records into 8 slots: 19 are lost before the reader looks
        write(ring, i)
    records = reader.read()
    assert reader.dropped == 19
    assert [r.op_id for r in records] == list(range(24, 32))


def test_a_claimed_slot_never_published_is_skipped_and_counted():
    ring = Ring(slots=16)
    reader = RingReader(ring, patience=2)
    write(ring, 0)
    claimed = struct.unpack_from("<Q", ring._map, 56)[0]  # a producer claimed index 1 and died
    struct.pack_into("<Q", ring._map, 56, claimed + 1)
    write(ring, 2)
    assert [r.op_id for r in reader.read()] == [0]  # waits for index 1 at first
    reader.read()
    assert [r.op_id for r in reader.read()] == [2]
    assert reader.dropped == 1


def test_concurrent_producers_lose_nothing_uncounted():
    ring = Ring(slots=1024)
    reader = RingReader(ring)
    threads, per_thread = 8, 20000
    seen, done = [], threading.Event()

    def produce(t):
        for i in range(per_thread):
            write(ring, t * per_thread + i)

    def consume():
        while not done.is_set():
            seen.extend(reader.read())
        seen.extend(reader.read())

    consumer = threading.Thread(target=consume)
    consumer.start()
    producers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    done.set()
    consumer.join()
    for r in seen:
        check(r)
    assert len({r.op_id for r in seen}) == len(seen)
    assert len(seen) + reader.dropped == threads * per_thread


def test_strings_of_any_length_are_interned_once_and_a_full_arena_is_counted():
    ring = Ring(slots=4, string_bytes=64)
    a, b = ring.intern("all_reduce"), ring.intern("[[4]]")
    assert ring.intern("all_reduce") == a and a != b
    assert ring.string(a) == "all_reduce" and ring.string(b) == "[[4]]"
    assert ring.intern("x" * 40) == 0 and ring.errors()["string_dropped"] == 1  # 8 + 40 bytes do not fit any more
    big = Ring(slots=4)
    ranks = json.dumps({"name": "0", "ranks": list(range(1024))})  # a 1,024-rank group's description
    assert json.loads(big.string(big.intern(ranks)))["ranks"] == list(range(1024))


def test_another_process_resolves_strings_interned_by_a_writer_that_has_died(tmp_path):
    path = str(tmp_path / "ring")
    script = ("import sys, json; from commlens.ring import Ring; ring = Ring(slots=8, path=sys.argv[1]); "
              "print(json.dumps([ring.intern(sys.argv[2]), ring.intern('é' * 300)]))")
    done = subprocess.run([sys.executable, "-c", script, path, "group " * 100], capture_output=True, text=True,
                          check=True)
    first, second = json.loads(done.stdout)
    ring = Ring.attach(path)
    assert ring.string(first) == "group " * 100 and ring.string(second) == "é" * 300
    assert ring.string(second + 1000) == ""  # never published
    mine = ring.intern("added by the reader")  # ids come from the shared counter: no clash
    assert mine not in (first, second) and Ring.attach(path).string(mine) == "added by the reader"


def test_creating_a_ring_again_leaves_a_reader_of_the_old_one_whole(tmp_path):
    path = str(tmp_path / "ring")
    old = Ring(slots=8, path=path)
    sid = old.intern("before the restart")
    reader = Ring.attach(path)
    Ring(slots=8, path=path)  # the rank restarted (torchelastic): a new file under the same name
    assert reader.string(sid) == "before the restart" and Ring.attach(path).string(sid) == ""



def test_another_process_reads_the_shared_ring(tmp_path):
    path = str(tmp_path / "ring")
    writer = subprocess.Popen([sys.executable, str(CHILDREN / "ring_writer.py"), path], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "written"
        ring = Ring.attach(path)
        reader = RingReader(ring)
        records = reader.read()
        assert [r.op_id for r in records] == list(range(36, 100)) and reader.dropped == 36
        assert {r.kind for r in records} == {START, END}
        assert ring.string(records[0].pg) == "group 0"
        assert all(r.nbytes == 4 * r.op_id for r in records)
    finally:
        writer.communicate("")



def test_a_writer_in_another_process_wakes_its_reader_as_its_ring_fills_and_its_end_lets_it_go(tmp_path):
    """The pod sidecar's wake-up: a ring file's FIFO gets a byte for each quarter of the ring its
    writer claims; the reader waits on it, and lets it go once the writer has ended."""
    path = str(tmp_path / "local-rank-0.ring")
    writer = subprocess.Popen([sys.executable, str(CHILDREN / "ring_writer.py"), path], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    wakes = WakeFiles()
    try:
        assert writer.stdout.readline().strip() == "written"  # 100 records into 64 slots: six quarters
        wakes.watch(path)
        assert wakes.wait(30) and not wakes.wait(0.05)  # woken once for what was written, then quiet
        writer.communicate("")
        assert wakes.wait(30) and not wakes.wait(0.05)  # its end, once: the FIFO is let go
        restarted = Ring(slots=64, path=path)  # a restarted rank: a new FIFO under the same name
        wakes.watch(path)
        for index in range(16):
            restarted.write(START, 1, 0, 0, index, index, 4, 0, -1, 0)
        assert wakes.wait(30)
    finally:
        wakes.close()


def test_a_killed_writer_is_seen_dead_while_its_forked_child_lives_and_a_closed_one_reopens(tmp_path):
    path = str(tmp_path / "ring")
    writer = subprocess.Popen([sys.executable, str(CHILDREN / "ring_killed_with_a_child.py"), path],
                              stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "forked\n"
        assert writer.wait(30) == -9
        assert not Ring.attach(path).writer_alive()  # the child still lives: it waits on its stdin
    finally:
        writer.communicate("")
    ring = Ring(slots=64, path=str(tmp_path / "mine"))
    reader = Ring.attach(str(tmp_path / "mine"))
    seen = [reader.writer_alive()]
    for step in (ring.close, ring.open):  # commlens stopped and started again in the same process
        step()
        seen.append(reader.writer_alive())
    assert seen == [True, False, True]


@pytest.mark.parametrize("slots", [0, 3, 100, "8"])
def test_bad_slot_counts_are_refused_with_what_is_accepted(slots):
    with pytest.raises(ValueError, match=r"slots=.* power of two"):
        Ring(slots=slots)


def test_a_producer_used_before_init_refuses_and_a_second_init_lets_go_of_the_first_buffer():
    from commlens.ring._producer import Producer

    with pytest.raises(ValueError, match="not initialised"):
        Producer.__new__(Producer).write(1, 0, 0, 0, 1, 1, 0, 0, -1, 0)
    first, second = bytearray(8 + 4 * 72), bytearray(8 + 4 * 72)
    producer = Producer(first, 4, 0, 8)
    producer.__init__(second, 4, 0, 8)
    first.extend(b"x")  # a buffer still held could not be resized (BufferError)
    producer.write(1, 0, 0, 0, 1, 1, 0, 0, -1, 0)
    assert second[:8] == (1).to_bytes(8, "little") and first[:8] == bytes(8)


def test_attaching_something_else_is_refused(tmp_path):
    path = tmp_path / "not-a-ring"
    path.write_bytes(b"x" * 200)
    with pytest.raises(ValueError, match="not a commlens ring"):
        Ring.attach(str(path))


BURST = 1_000_000

def test_a_reader_in_another_process_never_accepts_a_torn_record_and_counts_every_drop(tmp_path):
    path = str(tmp_path / "ring")
    writer = subprocess.Popen([sys.executable, str(CHILDREN / "ring_burst_writer.py"), path, str(BURST)],
                              stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        reader = RingReader(Ring.attach(path))
        done = threading.Event()
        threading.Thread(target=lambda: writer.stdout.readline() and done.set(), daemon=True).start()
        writer.stdin.write("go\n")
        writer.stdin.flush()
        records = []
        while not done.is_set():  # reading while the other process writes a small ring, lapping it often
            records += reader.read()
        records += reader.read()
    finally:
        writer.communicate("")
    assert records, "the reader saw nothing"
    assert all(r.head - 1 == r.op_id and r.seq == 3 * r.op_id and r.nbytes == 7 * r.op_id and
               r.aux == (5 * r.op_id) & 0xFFFFFFFF and r.op == r.op_id & 0xFF and r.pg == r.op_id & 0xFFFF
               for r in records)  # no record mixes two writes
    ids = [r.op_id for r in records]
    assert ids == sorted(set(ids))
    assert len(records) + reader.dropped == BURST


def test_reading_and_draining_a_ring_imports_no_torch():
    script = ("import sys; from commlens.ring import Ring, RingReader; import commlens.agent.sidecar, "
              "commlens.agent.stats, commlens.exporters.prometheus, commlens.exporters.otlp; "
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
