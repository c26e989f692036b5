"""Every public torch.distributed op, sync and async, on real gloo processes."""

import threading
import warnings

import torch
import torch.distributed as dist
from torch.distributed import all_reduce as all_reduce_bound_before_instrumenting

import commlens.hooks as ch


def every_op(rank, world_size):
    """Issue each op once (sync, then async where it has async_op) and return what the hooks saw."""
    ch.instrument()
    ch.instrument()  # idempotent
    seen = []
    order = []
    ch.register_pre_hook(lambda a: order.append(("first", a.op_id)))
    ch.register_pre_hook(lambda a: order.append(("second", a.op_id)))
    ch.register_post_hook(lambda a: seen.append((a.name.value, a.pre.pg_name, a.pre.seq, a.pre.async_op,
                                                a.status, a.end_ns >= a.start_ns, a.pre.root, a.pre.peer)))
    ws, t = world_size, torch.ones(4)
    sub = dist.new_group([0, 1])
    peer = 1 - rank if rank < 2 else None
    for async_op in (False, True):
        works = [
            dist.all_reduce(t, async_op=async_op),
            dist.broadcast(t, 0, async_op=async_op),
            dist.reduce(t, 0, async_op=async_op),
            dist.all_gather([torch.empty(4) for _ in range(ws)], t, async_op=async_op),
            dist.all_gather_into_tensor(torch.empty(4 * ws), t, async_op=async_op),
            dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * ws), async_op=async_op),
            dist.all_to_all_single(torch.empty(4 * ws), torch.ones(4 * ws), async_op=async_op),
            dist.gather(t, [torch.empty(4) for _ in range(ws)] if rank == 0 else None, 0, async_op=async_op),
            dist.scatter(t, [torch.ones(4) for _ in range(ws)] if rank == 0 else None, 0, async_op=async_op),
            dist.barrier(async_op=async_op),
            dist.all_reduce(t, group=sub, async_op=async_op),
        ]
        for w in works:
            if async_op and w is not None:
                w.wait()
    if peer is not None:
        (dist.send if rank == 0 else dist.recv)(t, peer)
        (dist.isend if rank == 0 else dist.irecv)(t, peer).wait()
        op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, peer)
        for w in dist.batch_isend_irecv([op]):
            w.wait()
    all_reduce_bound_before_instrumenting(t)
    dist.barrier()
    c10d_seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    torch_fr = torch._C._distributed_c10d._dump_fr_trace()
    ch.uninstrument()
    ch.uninstrument()
    before = len(seen)
    dist.all_reduce(t)
    poll_until(lambda: len([s for s in seen if s[3]]) >= (10 if peer is None else 13))
    return {"seen": seen, "order": order, "after_uninstrument": len(seen) - before, "c10d_seq": c10d_seq,
            "torch_fr": torch_fr, "restored": dist.all_reduce.__code__.co_freevars == ("func",)
            and dist.isend.__code__.co_name == "isend"}


def poll_until(condition, timeout_s=10.0):
    """Wait for async post-hooks, which fire on another thread, by waiting on their effect."""
    ready = threading.Event()
    for _ in range(int(timeout_s * 1000)):
        if condition():
            return
        ready.wait(0.001)
    raise AssertionError("timed out waiting for async post-hooks")


def test_every_op_is_recorded_sync_and_async_with_c10d_sequence_numbers(run_ranks, monkeypatch):
    import pickle

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "200")  # c10d's own recorder, to compare numbering with
    results = run_ranks(every_op, 3)
    for rank, r in enumerate(results):
        names = [s[0] for s in r["seen"]]
        for op in ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                   "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter", "barrier"):
            assert any(s[0] == op and not s[3] for s in r["seen"]), (rank, op, "sync")
            # gloo's async reduce_scatter_tensor work has no future and never reports completion:
            # it completes when waited for
            assert any(s[0] == op and s[3] for s in r["seen"]), (rank, op, "async")
        assert all(s[4] == "ok" and s[5] for s in r["seen"])
        if rank < 2:
            assert names.count("send" if rank == 0 else "recv") == 3
            assert [s[7] for s in r["seen"] if s[0] in ("send", "recv")] == [1 - rank] * 3
        else:
            assert "send" not in names and "recv" not in names
            assert not any(s[1] == "1" for s in r["seen"])  # not a member of the subgroup
        # hooks run in registration order, once per op
        firsts = [i for who, i in r["order"] if who == "first"]
        assert r["order"] == [x for i in firsts for x in (("first", i), ("second", i))]
        assert r["after_uninstrument"] == 0 and r["restored"]
    # the same collective has the same (group, seq) on every rank, equal to c10d's own numbering
    world = [sorted((s[2], s[0]) for s in r["seen"] if s[1] == "0" and s[0] not in ("send", "recv"))
             for r in results]
    assert world[0] == world[1] == world[2]
    assert world[0][-1][0] == results[2]["c10d_seq"]  # rank 2 did no p2p: c10d counts collectives only
    fr = pickle.loads(results[0]["torch_fr"])
    c10d_seqs = sorted(e["collective_seq_id"] for e in fr["entries"] if e["process_group"][0] == "0")
    assert [seq for seq, _ in world[0]] == c10d_seqs
    assert [s[6] for s in results[1]["seen"] if s[0] in ("broadcast", "reduce", "gather", "scatter")] == [0] * 8


def raising_hooks(rank, world_size):
    ch.instrument()
    calls = []

    def broken(args):
        raise ValueError("hook bug")

    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = ch.register_pre_hook(broken)
        ch.register_post_hook(lambda a: calls.append(a.name.value))
        t = torch.ones(2)
        dist.all_reduce(t)
        dist.all_reduce(t)
        handle.remove()
        handle.remove()  # idempotent
        dist.all_reduce(t)
    return {"value": t.tolist(), "calls": calls, "errors": dict(ch.hook_errors),
            "warnings": [str(w.message) for w in caught if "hook bug" in str(w.message)]}


def test_a_raising_hook_is_counted_and_reported_once_and_the_collective_goes_on(run_ranks):
    for r in run_ranks(raising_hooks, 2):
        assert r["value"] == [8.0, 8.0]
        assert r["calls"] == ["all_reduce"] * 3
        assert list(r["errors"].values()) == [2]
        assert len(r["warnings"]) == 1 and "broken" in r["warnings"][0]


def all_reduce_every_way(rank, world_size):
    """all_reduce as users call it, no hooks registered (its one-frame path), then a bad call."""
    from commlens.ring.layout import END, START

    ch.instrument()
    reader = ch.RingReader(ch.ring(), start=ch.ring().claimed())
    t = torch.empty(3)
    calls = [lambda: dist.all_reduce(t), lambda: dist.all_reduce(t, dist.ReduceOp.MAX),
             lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=None), lambda: dist.all_reduce(tensor=t),
             lambda: dist.all_reduce(t, async_op=True).wait()]
    reduced = []
    for call in calls:
        t.fill_(rank + 1.0)
        call()
        reduced.append(t.tolist())
    records = []
    poll_until(lambda: records.extend(reader.read()) or sum(r.kind == END for r in records) == len(calls))
    errors = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # instrumented, then not: the same error reaches the caller
            try:
                dist.all_reduce([t])
            except Exception as error:
                errors.append((type(error), str(error)))
            ch.uninstrument()
    return {"reduced": reduced, "errors": errors, "dropped": reader.dropped,
            "warnings": [str(w.message) for w in caught if "commlens" in str(w.message)],
            "records": [(r.kind, r.seq, r.phase) for r in records + reader.read() if r.kind in (START, END)]}


def test_all_reduce_called_every_way_reduces_as_torch_does_and_is_recorded_once_each(run_ranks):
    from commlens.ring.layout import END, OK, START

    for r in run_ranks(all_reduce_every_way, 2):
        assert r["reduced"] == [[3.0] * 3, [2.0] * 3, [1.0] * 3, [3.0] * 3, [3.0] * 3]
        assert r["errors"][0] == r["errors"][1]  # torch's own error, as without commlens
        assert r["warnings"] == []  # the caller's mistake, not a failure of commlens
        assert r["dropped"] == 0
        first = min(seq for _, seq, _ in r["records"])
        assert sorted(r["records"]) == sorted((kind, seq, OK) for seq in range(first, first + 5) for kind in (START, END))


def all_reduce_failing(rank, world_size):
    """all_reduce's common case (in C) when the backend raises, and when commlens itself fails."""
    from commlens.hooks import groups

    ch.instrument()
    reader = ch.RingReader(ch.ring(), start=ch.ring().claimed())
    aborted = []
    ch.register_abort_hook(lambda a: aborted.append((a.pre.name.value, a.pre.seq, a.status)))
    t = torch.ones(3)
    dist.all_reduce(t)
    try:
        dist.all_reduce(t, dist.ReduceOp.BAND)  # gloo refuses a bitwise reduction of floats, in both ranks
    except Exception as error:
        raised = (type(error), str(error))
    ch.uninstrument()
    try:
        dist.all_reduce(t, dist.ReduceOp.BAND)
    except Exception as error:
        unrecorded = (type(error), str(error))
    ch.instrument()
    dist.all_reduce(t)
    groups.known[None].seq_source = lambda: 1 // 0  # commlens' own numbering fails from now on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fill_(rank + 1.0)
        dist.all_reduce(t)
        dist.all_reduce(t)
    records = []
    poll_until(lambda: records.extend(reader.read()) or len(records) >= 6)
    ch.uninstrument()
    return {"raised": raised, "unrecorded": unrecorded, "aborted": aborted, "reduced": t.tolist(),
            "records": [(r.kind, r.seq, r.flags) for r in records], "errors": dict(ch.ring().errors()),
            "warnings": [str(w.message) for w in caught if "commlens" in str(w.message)]}


def test_an_all_reduce_that_raises_is_recorded_as_failed_and_a_failure_of_commlens_leaves_it_unrecorded(run_ranks):
    from commlens.ring.layout import END, ERROR, OK, START

    for r in run_ranks(all_reduce_failing, 2):
        assert r["raised"] == r["unrecorded"]  # torch's own error, as without commlens
        records = r["records"]  # in the order written: one thread
        assert [(kind, flags) for kind, _, flags in records] == [
            (START, 0), (END, OK), (START, 0), (END, ERROR), (START, 0), (END, OK)]
        assert [seq for _, seq, _ in records[::2]] == [seq for _, seq, _ in records[1::2]]
        assert r["aborted"] == [("all_reduce", records[2][1], "error")]
        assert r["reduced"] == [3.0 * 2] * 3  # both unrecorded all_reduces still reduced
        assert r["errors"]["recorder"] == 2
        assert len(r["warnings"]) == 1 and "ZeroDivisionError" in r["warnings"][0]


def concurrent_threads(rank, world_size):
    ch.instrument()
    groups = [dist.new_group([0, 1]) for _ in range(4)]
    reader = ch.RingReader(ch.ring(), start=0)

    def issue(g):
        for _ in range(200):
            dist.all_reduce(torch.ones(8), group=g)

    threads = [threading.Thread(target=issue, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = reader.read()
    return {"records": [(r.kind, r.pg, r.seq, r.nbytes) for r in records], "dropped": reader.dropped}


def test_threads_issuing_collectives_concurrently_lose_nothing(run_ranks):
    for r in run_ranks(concurrent_threads, 2):
        assert r["dropped"] == 0
        records = [x for x in r["records"] if x[3] == 32]
        assert len(records) == 4 * 200 * 2
        by_group = {}
        for kind, pg, seq, _ in records:
            by_group.setdefault((pg, kind), []).append(seq)
        assert len(by_group) == 8
        assert all(sorted(seqs) == list(range(1, 201)) for seqs in by_group.values())


def test_registering_bad_hooks_fails_at_once_with_a_clear_error():
    import pytest

    with pytest.raises(TypeError, match="takes a callable; got int 3"):
        ch.register_pre_hook(3)

    def hook(args):
        pass

    handle = ch.register_post_hook(hook)
    with pytest.raises(ValueError, match="already registered among the post hooks"):
        ch.register_post_hook(hook)
    handle.remove()
    ch.register_post_hook(hook).remove()


def test_a_rank_that_exits_while_a_completion_callback_runs_exits_cleanly(tmp_path):
    """The callback runs on gloo's C++ thread; the process must not end under it (std::terminate, SIGABRT)."""
    import pathlib
    import subprocess
    import sys

    from ports import free_port

    done = tmp_path / "post-hook-finished"
    child = pathlib.Path(__file__).resolve().parent / "children" / "exit_right_after_a_collective.py"
    ended = subprocess.run([sys.executable, str(child), str(free_port()), str(done)], capture_output=True, text=True,
                           timeout=60)
    assert ended.returncode == 0 and not ended.stderr.strip(), (ended.returncode, ended.stderr)
    assert done.exists()  # the post-hook ran to its end before the process did
