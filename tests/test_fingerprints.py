"""Replica fingerprints (hooks/fingerprints.py): a group's every Nth all_reduce, broadcast and all_gather has its
result fingerprinted on every rank alike; a rank whose result was corrupted is named, and only it."""

import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import commlens.agent
import commlens.hooks as ch
from commlens.agent.config import Config
from commlens.agent.verdicts import findings, readers
from commlens.hooks import fingerprints
from commlens.hooks._state import state
from commlens.ring import RingReader
from commlens.ring.layout import END, FINGERPRINT
from commlens.ring.ops import OPS

EVERY = 2


def replica_ops(rank, world_size, hooked):
    """Every replica op, sync and async, on the paths a hook or none takes; what the ring holds of them."""
    ch.instrument()
    state.fingerprint_every = EVERY
    if hooked:
        ch.register_post_hook(lambda args: None)
    reader = RingReader(ch.ring())
    t = torch.arange(8, dtype=torch.float32)
    results = []
    for async_op in (False, True):
        for issue in (lambda: dist.all_reduce(t, async_op=async_op), lambda: dist.broadcast(t, 0, async_op=async_op),
                      lambda: dist.all_gather(outputs := [torch.empty(8) for _ in range(world_size)], t,
                                              async_op=async_op) and outputs,
                      lambda: dist.all_gather_into_tensor(out := torch.empty(8 * world_size), t, async_op=async_op)
                      and out, lambda: dist.reduce(t, 0, async_op=async_op)):
            work = issue()
            if async_op and hasattr(work, "wait"):
                work.wait()
            results.append(t.clone())
    records = []
    while len([r for r in records if r.kind == END]) < 10:  # async ops end on the backend's threads
        records += reader.read()
    ch.uninstrument()
    state.fingerprint_every = 0
    prints = [(r.op_id, r.seq, OPS[r.op].value, r.nbytes, r.aux) for r in records if r.kind == FINGERPRINT]
    ends = {r.op_id: k for k, r in enumerate(records) if r.kind == END}
    before_end = all(k < ends[r.op_id] for k, r in enumerate(records) if r.kind == FINGERPRINT)
    return prints, before_end, fingerprints.of((torch.arange(8, dtype=torch.float32) * world_size,))


def test_every_nth_replica_op_is_fingerprinted_before_its_end_alike_on_every_rank(run_ranks):
    for hooked in (False, True):
        (prints0, before0, _), (prints1, before1, _) = run_ranks(replica_ops, 2, hooked=hooked)
        assert before0 and before1
        assert [p[1:] for p in prints0] == [p[1:] for p in prints1], (prints0, prints1)  # seq, op, value, every
        assert {seq for _, seq, *_ in prints0} == {seq for seq in range(1, 11) if seq % EVERY == 0} - {10}, prints0
        assert {op for _, _, op, _, _ in prints0} <= {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor"}
        assert all(every == EVERY and 0 <= value < 1 << 48 for *_, value, every in prints0)


def corrupting_training(rank, world_size, out, culprit):
    """A DDP job whose ``culprit`` rank's communication hook flips one exponent bit of one element of its
    reduced gradients at step 3; its agent writes spans to ``out``."""
    os.environ.update(COMMLENS_FINGERPRINT_EVERY="1", COMMLENS_TRACE_FILE=os.path.join(out, f"traces-{rank}.jsonl"))
    agent = commlens.agent.start(Config.from_env({**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                                  "WORLD_SIZE": str(world_size)}))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)))
    step = [0]

    def hook(process_group, bucket):
        def corrupt(future):
            result = future.value()
            result = result[0] if isinstance(result, list) else result
            if rank == culprit and step[0] == 3:
                result.view(torch.int32)[5] ^= 1 << 29  # an exponent bit: a silent corruption of the transfer
            return result
        return default_hooks.allreduce_hook(process_group, bucket).then(corrupt)

    model.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step[0] in range(6):
        optimizer.zero_grad()
        model(torch.randn(16, 32)).sum().backward()
        optimizer.step()
    commlens.agent.stop()


def test_a_rank_whose_reduced_gradients_were_corrupted_is_named_and_no_other_is(run_ranks, tmp_path):
    for culprit in (0, 2):
        out = tmp_path / f"culprit-{culprit}"
        out.mkdir()
        run_ranks(corrupting_training, 3, out=str(out), culprit=culprit)
        found = [f for f in findings(readers.from_files(str(out))) if f.kind == "replica_mismatch"]
        assert [f.ranks for f in found] == [(culprit,)], [f.line() for f in found]


def test_a_fingerprint_whose_end_is_lost_is_forgotten_and_the_next_ones_reach_their_spans():
    """A ring of 16 slots: 40 fingerprinted all_reduces whose ENDs were lost (dropped on a full ring), then
    one that ends. The sidecar keeps no more fingerprints than collectives can be in flight, and the one
    that ended carries its fingerprint on its span and in the group's exported slots."""
    import json
    import time

    from commlens.agent.sidecar import Sidecar
    from commlens.ring import Ring
    from commlens.ring.layout import START
    from commlens.ring.ops import CODE, OpName

    ring, seen = Ring(slots=16), []
    sidecar = Sidecar(ring, rank=0, hang_threshold_s=60, on_collective=seen.append)
    pg = ring.intern(json.dumps({"name": "0", "desc": "default", "ranks": [0, 1], "rank": 0, "backend": "gloo"}))
    sig = ring.intern(json.dumps([[[16]], ["Float"], [[16]], ["Float"]]))
    now, op = time.monotonic_ns(), CODE[OpName.all_reduce]
    for op_id in range(1, 42):
        t = now + op_id * 1_000_000
        ring.write(START, op, 0, pg, op_id, op_id, 64, sig, -1, 0, 0, t)
        ring.write(FINGERPRINT, op, 0, pg, op_id, op_id, 1000 + op_id, sig, -1, 1, 0, t + 40_000)
        if op_id == 41:
            ring.write(END, op, 0, pg, op_id, op_id, 64, sig, -1, 0, 0, t + 50_000)
        sidecar.drain()
    assert len(sidecar.join.fingerprints) <= ring.slots
    assert [(c.seq, c.fingerprint) for c in seen] == [(41, 1041)]
    assert sidecar.stats.fingerprints[("0", str(41 % 4))] == (41, 1041, "all_reduce")


def test_a_collective_is_compared_once_every_member_holds_its_fingerprint():
    """Live, rank 1 has not yet reached seq 64 that ranks 0 and 2 fingerprinted, differently: comparing
    the two would name both; nobody is named until rank 1's arrives, then rank 2 alone."""
    from commlens.agent.verdicts.facts import RankFacts

    facts = [RankFacts(rank) for rank in range(3)]
    for f, value in zip(facts, (111, None, 999)):
        f.group("0").fingerprints = {} if value is None else {64: ("all_reduce", value)}
    assert not [f for f in findings(facts) if f.kind == "replica_mismatch"]
    facts[1].group("0").fingerprints = {64: ("all_reduce", 111)}
    found = [f for f in findings(facts) if f.kind == "replica_mismatch"]
    assert [(f.ranks, f.pg, f.op, f.seq) for f in found] == [((2,), "0", "all_reduce", 64)]
    assert found[0].line().startswith("corrupted result: rank 2 in all_reduce (group 0, seq 64) — its result differs")
    facts[1].group("0").fingerprints = {64: ("all_gather", 111)}  # another op at that seq: a desync's, not compared
    assert not [f for f in findings(facts) if f.kind == "replica_mismatch"]


def test_a_rank_without_the_group_leaves_the_comparison_alone():
    """Rank 3, a pipeline stage that never joined group 0's collectives (its facts hold only group 1), is
    no member to wait for: ranks 0-2 are compared, and rank 2 named."""
    from commlens.agent.verdicts.facts import RankFacts

    facts = [RankFacts(rank) for rank in range(4)]
    for f, value in zip(facts, (111, 111, 999)):
        f.group("0").fingerprints = {64: ("all_reduce", value)}
    facts[3].group("1").fingerprints = {}
    assert [f.ranks for f in findings(facts) if f.kind == "replica_mismatch"] == [(2,)]
