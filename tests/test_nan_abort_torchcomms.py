"""NaN/Inf checks, abort hooks on a real timeout, and torchcomms communicators (a stand-in)."""

import dataclasses
import datetime
import gc
import weakref

import pytest
import torch
import torch.distributed as dist

import commlens.hooks as ch
from commlens.hooks.nan_check import FLAG_INF, FLAG_NAN
from conftest import everyone_here


def nan_report(rank, world_size):
    ch.instrument()
    reader = ch.RingReader(ch.ring())
    with ch.NanCheckHook(mode="report", check_outputs=True):
        t = torch.ones(4)
        if rank == 1:
            t[2] = float("nan")
            t[3] = float("inf")
        dist.all_reduce(t)  # proceeds; the NaN spreads to every rank's output
        dist.all_reduce(torch.ones(3, dtype=torch.int64))  # not floating point: skipped
    return [(r.flags, r.aux, r.nbytes) for r in reader.read() if r.kind == ch.NAN]


def test_report_mode_records_nan_and_inf_and_lets_the_collective_run(run_ranks):
    rank0, rank1 = run_ranks(nan_report, 2)
    assert rank1[0] == (FLAG_NAN | FLAG_INF, 0, 2)  # input tensor 0: one NaN, one Inf
    assert [f for f, _, _ in rank0] == [1 | FLAG_NAN | FLAG_INF]  # only the output, after the all_reduce


def nan_report_inputs(rank, world_size):
    ch.instrument()
    reader = ch.RingReader(ch.ring())
    big = torch.ones(1 << 19)  # too large to scan on the CPU: summed by torch
    big[-1] = float("inf")
    strided = torch.ones(4, 3)
    strided[1, 0] = float("nan")
    class Check(ch.NanCheckHook):  # counts the collectives its Python hook saw
        hooked = 0

        def _pre(self, args):
            self.hooked += 1
            super()._pre(args)

    # inputs only: finite collectives keep the unhooked path, and a scanned one holding NaN its record,
    # which the C all_reduce writes: the hook sees only the two its scan cannot read
    with Check(mode="report") as check:
        dist.all_reduce(torch.ones(8))
        dist.all_reduce(torch.tensor([1.0, float("nan"), float("nan")], dtype=torch.bfloat16))
        dist.all_reduce(big)
        dist.all_reduce(strided[:, 0])
        dist.all_reduce(torch.ones(8))
    records = reader.read()
    ops = {r.op_id for r in records if r.kind == ch.START}
    # each NAN record comes before its collective's START, whichever path wrote it
    firsts = [next(r.kind for r in records if r.op_id == op_id) for op_id in {r.op_id for r in records}]
    return (len(ops), [(r.flags, r.nbytes) for r in records if r.kind == ch.NAN], check.events, firsts.count(ch.NAN),
            check.hooked)


def test_report_mode_on_inputs_counts_what_each_collective_held(run_ranks):
    for collectives, found, events, nan_first, hooked in run_ranks(nan_report_inputs, 2):
        assert collectives == 5
        assert found == [(FLAG_NAN, 2), (FLAG_INF, 1), (FLAG_NAN, 1)]
        assert events == 3 and nan_first == 3 and hooked == 2


def broadcast_into_a_nan_buffer(rank, world_size, mode):
    ch.instrument()
    reader = ch.RingReader(ch.ring())
    with ch.NanCheckHook(mode=mode):
        # the receiving ranks' buffers hold NaN (as torch.empty may): not an input of theirs
        t = torch.ones(4) if rank == 0 else torch.full((4,), float("nan"))
        dist.broadcast(t, src=0)
        u = torch.full((4,), float("nan")) if rank == 1 else torch.zeros(4)
        try:
            if mode == "report" or rank == 1:  # raised before it is issued: no other rank joins
                dist.broadcast(u, src=1)  # this root's input holds NaN
        except RuntimeError as error:
            found = [str(error)]
        else:
            found = [(r.flags, r.nbytes) for r in reader.read() if r.kind == ch.NAN]
    return t.tolist(), found


@pytest.mark.parametrize("mode", ["report", "raise"])
def test_a_broadcast_is_checked_on_its_root_only(run_ranks, mode):
    (received0, found0), (received1, found1) = run_ranks(broadcast_into_a_nan_buffer, 2, mode=mode)
    assert received0 == received1 == [1.0] * 4  # the first broadcast completed on both ranks
    if mode == "report":
        assert found0 == [] and found1 == [(FLAG_NAN, 4)]
    else:
        assert found0 == [] and "input tensor 0 holds 4 NaN" in found1[0]


@dataclasses.dataclass
class SeenSeqs:
    """A user's pre-hook; a dataclass instance is unhashable (eq=True), as any callable may be."""

    seqs: list

    def __call__(self, args):
        self.seqs.append(args.seq)


def pre_hook_beside_the_check(rank, world_size):
    ch.instrument()
    seen = SeenSeqs([])
    with ch.NanCheckHook(mode="report"):
        handle = ch.register_pre_hook(seen)
        dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(4))
        handle.remove()
        dist.all_reduce(torch.ones(4))  # the check alone again
    return seen.seqs


def test_a_users_pre_hook_beside_the_nan_check_sees_every_collective_until_removed(run_ranks):
    for seqs in run_ranks(pre_hook_beside_the_check, 2):
        assert len(seqs) == 2 and seqs[1] == seqs[0] + 1, seqs


def nan_raise(rank, world_size):
    ch.instrument()
    aborts = []
    ch.register_abort_hook(lambda a: aborts.append(a.name.value))
    ch.NanCheckHook(mode="raise").register_with_comm()
    t = torch.zeros(4) if rank == 0 else torch.tensor([0.0, float("inf"), 1.0, 2.0])
    if rank == 0:
        return None
    with pytest.raises(RuntimeError) as raised:
        dist.all_reduce(t)
    return {"message": str(raised.value), "aborts": aborts}


def test_raise_mode_refuses_the_collective_naming_what_was_found(run_ranks):
    _, r = run_ranks(nan_raise, 2)
    assert r["message"].startswith("commlens NaN check: all_reduce (op_id ")
    assert "on rank 1, group '0': input tensor 0 holds 0 NaN and 1 Inf of 4 elements" in r["message"]
    assert r["aborts"] == ["all_reduce"]


def refused_then_let_go(rank, world_size):
    ch.instrument()
    gc.disable()  # what a reference cycle holds stays held
    try:
        with ch.NanCheckHook(mode="raise"):
            t = torch.full((4,), float("nan"))  # on every rank: no rank issues it
            tensor, group = weakref.ref(t), weakref.ref(dist.new_group([0, 1]))
            everyone_here("group created", rank, world_size)  # no rank uses it: none destroys it too soon
            try:
                dist.all_reduce(t, group=group())
            except RuntimeError:
                pass
        del t
        dist.destroy_process_group(group())
        return tensor() is None, group() is None
    finally:
        gc.enable()


def test_a_refused_collective_holds_neither_its_tensor_nor_its_group_once_its_error_is_dropped(run_ranks):
    # else the group outlives destroy_process_group until a garbage collection: as the process exits,
    # maybe after its peers have gone
    assert run_ranks(refused_then_let_go, 2) == [(True, True)] * 2


def test_bad_nan_mode_is_refused():
    with pytest.raises(ValueError, match="mode='warn' is not accepted: use one of report, raise"):
        ch.NanCheckHook(mode="warn")


def abort_on_timeout(rank, world_size):
    ch.instrument()
    events = []
    ch.register_abort_hook(lambda a: events.append(("abort", a.name.value, a.status)))

    def saving_debug_info():  # torchcomms' form: no argument
        events.append(("about to abort",))

    ch.register_abort_hook(saving_debug_info)
    with pytest.raises(ValueError, match="already registered among the abort hooks"):
        ch.register_abort_hook(saving_debug_info)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # never joins the all_reduce, and stays connected until rank 0 has seen why
        store.wait(["rank 0 done"], datetime.timedelta(seconds=60))
        return None
    try:
        dist.all_reduce(torch.ones(2))
    except RuntimeError:
        events.append(("caller saw the error",))
    store.set("rank 0 done", "1")
    return events


def test_abort_hooks_fire_before_a_timeout_reaches_the_caller_with_or_without_an_argument(run_ranks):
    events, _ = run_ranks(abort_on_timeout, 2, timeout_s=2)
    assert events == [("abort", "all_reduce", "timeout"), ("about to abort",), ("caller saw the error",)]


class StandInComm:
    """A stand-in for a torchcomms communicator, with its hook API (torchcomms does not install here)."""

    def __init__(self, form):
        self.form, self.hooks = form, {"pre": [], "post": [], "abort": []}

    def _register(self, kind, fn):
        self.hooks[kind].append(fn)
        comm = self

        class Handle:
            def remove(self):
                if fn in comm.hooks[kind]:
                    comm.hooks[kind].remove(fn)

        return Handle()

    register_pre_hook = lambda self, fn: self._register("pre", fn)  # noqa: E731
    register_post_hook = lambda self, fn: self._register("post", fn)  # noqa: E731
    register_abort_hook = lambda self, fn: self._register("abort", fn)  # noqa: E731
    get_rank, get_size, get_name, get_backend = (lambda self: 0), (lambda self: 2), (lambda self: "tp"), (lambda self: "nccl")

    def all_reduce(self, tensor, op_id):
        class Args:
            pass

        args = Args()
        args.name, args.op_id, args.tensors, args.async_op = "all_reduce", op_id, [tensor], False
        for fn in list(self.hooks["pre"]):
            fn(args) if self.form == "v0.2" else fn("all_reduce", op_id, args)
        for fn in list(self.hooks["post"]):
            fn(args) if self.form == "v0.2" else fn("all_reduce", op_id, args)

    def abort(self):
        for fn in list(self.hooks["abort"]):
            fn()


@pytest.mark.parametrize("form", ["v0.2", "v0.3"])
def test_torchcomms_communicators_feed_the_same_hooks_and_recorder(form):
    comm = StandInComm(form)
    seen = []
    handle = ch.register_post_hook(lambda a: seen.append((a.name.value, a.pre.pg_name, a.pre.seq)))
    recorder = ch.FlightRecorderHook(max_entries=8).register_with_comm(comm)
    check = ch.NanCheckHook(mode="raise").register_with_comm(comm)
    comm.all_reduce(torch.ones(4), op_id=1)
    with pytest.raises(RuntimeError, match="all_reduce .* group 'tp': input tensor 0 holds 1 NaN"):
        comm.all_reduce(torch.tensor([float("nan")]), op_id=2)
    comm.abort()
    check.unregister()
    recorder.unregister()
    handle.remove()
    assert comm.hooks == {"pre": [], "post": [], "abort": []}
    assert seen[0] == ("all_reduce", "tp", 1)
    entries = recorder.dump()["entries"]
    assert [(e["profiling_name"], e["collective_seq_id"], e["state"], e["status"]) for e in entries] == [
        ("nccl:all_reduce", 1, "completed", "ok"), ("nccl:all_reduce", 2, "completed", "error")]


def test_register_with_comm_refuses_what_is_not_a_communicator():
    with pytest.raises(TypeError, match="takes a torchcomms communicator .* object has no register_pre_hook"):
        ch.NanCheckHook().register_with_comm(object())


def test_collectives_whose_post_hook_never_comes_are_let_go_past_a_bound_and_counted(monkeypatch):
    from commlens.hooks import torchcomms

    monkeypatch.setattr(torchcomms, "FLIGHTS_MAX", 4)
    comm = StandInComm("v0.3")
    recorder = ch.FlightRecorderHook(max_entries=8).register_with_comm(comm)
    before = ch.ring().errors()["work_unjudged"]

    class Args:
        tensors, async_op = [torch.ones(4)], True

    for op_id in range(10):  # pre-hooks only: their collectives never say they ended
        for fn in list(comm.hooks["pre"]):
            fn("all_reduce", op_id, Args())
    held = len(torchcomms._sources[id(comm)]._flights)
    recorder.unregister()
    assert held == 4 and ch.ring().errors()["work_unjudged"] - before == 6
