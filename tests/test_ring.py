"""The ring: records in order, exact overwrite counts, threads, another process reading it."""

import struct
import subprocess
import sys
import threading

import pytest

from commlens.hooks import END, START, Ring, RingReader


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


def test_strings_are_interned_once():
    ring = Ring(slots=4, strings=4)
    a, b = ring.intern("all_reduce"), ring.intern("[[4]]")
    assert ring.intern("all_reduce") == a and a != b
    assert ring.string(a) == "all_reduce"
    ring.intern("x"), ring.intern("y")
    assert ring.intern("z") == 0 and ring.strings_dropped >= 1


WRITER = """
import sys
from commlens.hooks import Ring, START, END
ring = Ring(slots=64, path=sys.argv[1])
sid = ring.intern("group 0")
for i in range(100):
    ring.write(START if i % 2 == 0 else END, 1, 0, sid, i, i, 4 * i, 0, -1, 0, 0, i)
print("written", flush=True)
sys.stdin.read()  # stay alive while the other process reads
"""


def test_another_process_reads_the_shared_ring(tmp_path):
    path = str(tmp_path / "ring")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, path], stdin=subprocess.PIPE,
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


@pytest.mark.parametrize("slots", [0, 3, 100, "8"])
def test_bad_slot_counts_are_refused_with_what_is_accepted(slots):
    with pytest.raises(ValueError, match=r"slots=.* power of two"):
        Ring(slots=slots)


def test_attaching_something_else_is_refused(tmp_path):
    path = tmp_path / "not-a-ring"
    path.write_bytes(b"x" * 200)
    with pytest.raises(ValueError, match="not a commlens ring"):
        Ring.attach(str(path))
