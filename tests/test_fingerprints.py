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
from commlens.agent.verdicts.facts import RankFacts
from commlens.agent.verdicts.readers.metrics import settle
from commlens.hooks import fingerprints
from commlens.hooks._state import state
from commlens.ring import RingReader
from commlens.ring.layout import END, FINGERPRINT
from commlens.ring.ops import OPS

EVERY = 2


def replica_ops(rank, world_size, hooked):
    """Every replica op, sync and async, on the paths a hook or none takes; what the ring holds of them, and
    the fingerprint of the broadcast's result (seq 2: the first all_reduce's, ``world_size`` times ``t``)."""
    ch.instrument()
    state.fingerprint_every = EVERY
    if hooked:
        ch.register_post_hook(lambda args: None)
    reader = RingReader(ch.ring())
    t = torch.arange(8, dtype=torch.float32)
    for async_op in (False, True):
        for issue in (lambda: dist.all_reduce(t, async_op=async_op), lambda: dist.broadcast(t, 0, async_op=async_op),
                      lambda: dist.all_gather(outputs := [torch.empty(8) for _ in range(world_size)], t,
                                              async_op=async_op) and outputs,
                      lambda: dist.all_gather_into_tensor(out := torch.empty(8 * world_size), t, async_op=async_op)
                      and out, lambda: dist.reduce(t, 0, async_op=async_op)):
            work = issue()
            if async_op and hasattr(work, "wait"):
                work.wait()
    records = []
    while len([r for r in records if r.kind == END]) < 10:  # async ops end on the backend's threads
        records += reader.read()
    ch.uninstrument()
    state.fingerprint_every = 0
    prints = [(r.op_id, r.seq, OPS[r.op].value, r.nbytes, r.aux) for r in records if r.kind == FINGERPRINT]
    ends = {r.op_id: k for k, r in enumerate(records) if r.kind == END}
    before_end = all(k < ends[r.op_id] for k, r in enumerate(records) if r.kind == FINGERPRINT)
    return prints, before_end, fingerprints.of((torch.arange(8, dtype=torch.float32) * world_size,))


def test_every_nth_sync_replica_op_is_fingerprinted_before_its_end_alike_on_every_rank(run_ranks):
    """Seqs 1-5 sync (all_reduce, broadcast, all_gather, all_gather_into_tensor, reduce), 6-10 async: the
    due ones (every 2nd) of the replica ops, but not the async ones, whose result is the caller's once its
    future completes, before commlens' callback could read it."""
    for hooked in (False, True):
        (prints0, before0, expected), (prints1, before1, _) = run_ranks(replica_ops, 2, hooked=hooked)
        assert before0 and before1
        assert [p[1:] for p in prints0] == [p[1:] for p in prints1], (prints0, prints1)  # seq, op, value, every
        assert [(seq, op) for _, seq, op, _, _ in prints0] == [(2, "broadcast"), (4, "all_gather_into_tensor")]
        assert prints0[0][3] == expected, (prints0, expected)
        assert all(every == EVERY and 0 <= value < 1 << 48 for *_, value, every in prints0)


def reference(data: bytes) -> int:
    """The fingerprint as hooks/_fingerprint.h defines it, in Python: the bytes as little-endian uint32
    words (the tail a last word), the sum of word i times 2i + 1 mod 2^32, and the plain sum's low 16
    bits above it."""
    words = [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)]
    weighted = sum(w * (2 * i + 1) for i, w in enumerate(words)) % (1 << 32)
    return weighted | (sum(words) & 0xFFFF) << 32


def test_a_fingerprint_is_the_defined_sum_of_its_bytes_at_any_address_and_length():
    bytes_ = torch.arange(1001, dtype=torch.int32).to(torch.int8)
    cases = {"float32": torch.linspace(-3, 3, 1000), "bfloat16, 14 bytes: a tail": torch.randn(7).to(torch.bfloat16),
             "int8 at an odd address": bytes_[1:], "3 bytes": bytes_[5:8], "empty": torch.empty(0)}
    for name, t in cases.items():
        data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        assert fingerprints.of((t,)) == reference(data), name
    assert fingerprints.of((torch.linspace(-3, 3, 1000)[::2],)) is None  # strided: not read here
    t = torch.linspace(-3, 3, 64)
    before = fingerprints.of((t,))
    words = t.view(torch.int32)
    for bit in range(0, 64 * 32, 7):  # a single flipped bit, anywhere, changes it
        mask = 1 << bit % 32 if bit % 32 != 31 else -(1 << 31)  # as an int32
        words[bit // 32] ^= mask
        assert fingerprints.of((t,)) != before, bit
        words[bit // 32] ^= mask
    assert fingerprints.of((t,)) == before


def corrupting_training(rank, world_size, out, culprit):
    """A DDP job whose ``culprit`` rank's communication hook flips one exponent bit of one element of its
    reduced gradients at step 3; its agent writes spans to ``out``."""
    os.environ.update(COMMLENS_FINGERPRINT_EVERY="1", COMMLENS_TRACE_FILE=os.path.join(out, f"traces-{rank}.jsonl"),
                      COMMLENS_METRICS_PORT="0")  # no endpoint: read after the fact, other jobs run beside
    commlens.agent.start(Config.from_env({**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                                  "WORLD_SIZE": str(world_size)}))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)))
    step = [0]

    def hook(process_group, bucket):
        def corrupt(future):
            result = future.value()
            result = result[0] if isinstance(result, list) else result
            if rank == culprit and step[0] == 3:  # a copy: what DDP gets is compared, not the bucket
                result = result.clone()
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


def diverging_training(rank, world_size, out, culprit, fault):
    """A DDP job (the C++ hook's buckets) whose ``culprit`` rank's gradients grow x1e3 from step 12
    (``scaled``, float32), or have one value's high exponent bit flipped at step 12 (``flipped``, a
    bfloat16 model); its agent writes spans to ``out``."""
    os.environ.update(COMMLENS_TRACE_FILE=os.path.join(out, f"traces-{rank}.jsonl"),
                      COMMLENS_METRICS_PORT="0")  # no endpoint: read after the fact, other jobs run beside
    commlens.agent.start(Config.from_env({**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                                  "WORLD_SIZE": str(world_size)}))
    torch.manual_seed(0)
    dtype = torch.bfloat16 if fault == "flipped" else torch.float32
    layers = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)).to(dtype)
    model = torch.nn.parallel.DistributedDataParallel(layers)
    step = [0]

    def flip(grad):
        if rank == culprit and fault == "flipped" and step[0] == 12:
            grad = grad.clone()
            grad.view(-1).view(torch.int16)[3] ^= 1 << 14  # the exponent's high bit: 2^128 times, or from 2^-127 up
        return grad

    layers[0].weight.register_hook(flip)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    torch.manual_seed(rank)
    for step[0] in range(20):
        optimizer.zero_grad()
        loss = model(torch.randn(16, 32).to(dtype)).float().sum()
        (loss * 1e3 if rank == culprit and fault == "scaled" and step[0] >= 12 else loss).backward()
        optimizer.step()
    commlens.agent.stop()


def test_a_rank_whose_gradients_grew_or_had_a_value_flipped_high_is_named_and_no_other_is(run_ranks, tmp_path):
    """Three DDP replicas on the C++ hook's path: the culprit's buckets jump in scale (x1e3 is 2^10; a flipped
    high exponent bit far more) where its replicas' do not; after the fact it alone is named, with the
    collective and the jump."""
    for culprit, fault in ((0, "scaled"), (2, "flipped")):
        out = tmp_path / f"{fault}-{culprit}"
        out.mkdir()
        run_ranks(diverging_training, 3, out=str(out), culprit=culprit, fault=fault)
        found = [f for f in findings(readers.from_files(str(out))) if f.kind == "diverging_input"]
        assert [f.ranks for f in found] == [(culprit,)], [f.line() for f in found]
        assert found[0].line().startswith(f"diverging input: rank {culprit} in all_reduce (group 0, seq ")
        assert "grew 2^" in found[0].evidence and "did not" in found[0].evidence, found[0].line()


def test_replicas_whose_scale_jumps_in_one_step_are_the_jobs_own_and_the_first_to_jump_alone_is_named():
    """Facts of 4 replicas: a loss scaler's growth makes ranks 0-2 jump in step 5, each at a bucket of its
    own (different seqs): the job's, nobody named. A minute later rank 3 jumps alone in step 9, and ranks 0-2
    in step 10 (what it sent them through the all_reduce): rank 3 is named, at its seq."""
    from commlens.agent.verdicts.facts import RankFacts

    facts = [RankFacts(rank) for rank in range(4)]
    for f in facts:
        f.group("1").scale_jumps = {}
    for rank, (seq, at) in enumerate([(40, 100.0), (41, 100.3), (43, 100.9)]):
        facts[rank].group("1").scale_jumps[seq] = (5, 8, at)
    assert not [f for f in findings(facts) if f.kind == "diverging_input"]
    facts[3].group("1").scale_jumps[90] = (9, 120, 170.0)
    for rank in range(3):
        facts[rank].group("1").scale_jumps[98 + rank] = (10, 90, 170.2)
    found = [f for f in findings(facts) if f.kind == "diverging_input"]
    assert [(f.ranks, f.seq) for f in found] == [((3,), 90)], [f.line() for f in found]
    assert "grew 2^120 over the bucket's recent scale in step 9, ranks [0, 1, 2]'s did not" in found[0].line()


def test_a_bucket_scale_is_judged_after_its_first_steps_against_its_own_median():
    from commlens.agent.scales import JUDGED_FROM, SCALE_JUMP, BucketScales

    scales, bucket, other = BucketScales(), ("0", 0, 4096), ("0", 0, 8192)  # a second model's bucket 0
    assert [scales.seen(bucket, -7 + (k % 3)) for k in range(JUDGED_FROM)] == [None] * JUDGED_FROM
    assert scales.seen(other, 40) is None  # its own history: none yet
    assert scales.seen(bucket, -6 + SCALE_JUMP - 1) is None  # 2^7 over the median (-6): no jump
    assert scales.seen(bucket, -6 + SCALE_JUMP) == SCALE_JUMP


def test_a_bucket_jump_read_live_is_evidence_while_its_time_is_within_what_the_reader_keeps():
    """``diagnose --metrics`` keeps a jump 5 min by the rank's clock (``jumps_since``); Prometheus' reader
    reads only recent ones (its clock) and keeps any it read; a rank with no jump has none."""
    def jumps(read: list, since: float | None) -> dict:
        facts = RankFacts(1)
        facts.group("3").scale_read = read
        settle(facts, False, set(), since)
        return facts.group("3").scale_jumps

    jumped = [2, 41, 20, 12, 1000.0]
    assert jumps(jumped, 999.0) == jumps(jumped, None) == {41: (20, 12, 1000.0)}
    assert jumps(jumped, 1000.0) == {}
    assert jumps([0, 0, 0, 0, 0.0], None) == {}
