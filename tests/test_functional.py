"""Functional collectives, DTensor and FSDP2 on 2 gloo ranks: recorded like any other collective."""

import urllib.request

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from prometheus_client.parser import text_string_to_metric_families
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from commlens.agent import Config
from commlens.ring.ops import OPS
import commlens.hooks as ch
import commlens.agent

from ports import free_ports


def _c10d_seq():
    return dist.group.WORLD._get_sequence_number_for_group()


def functional_ops(rank, world_size):
    ch.instrument()
    seen = []
    handle = ch.register_post_hook(lambda a: seen.append(
        (a.name.value, a.pre.seq, a.status, a.pre.nbytes, [tuple(t.shape) for t in a.output_tensors])))
    pg = dist.group.WORLD
    t = torch.arange(4.0) + rank
    values = {
        "all_reduce": funcol.all_reduce(t, "sum", pg).wait(),
        "all_gather": funcol.all_gather_single(t, 0, pg).wait(),
        "all_gather_dim1": funcol.all_gather_single(t.view(2, 2), 1, pg) * 1,  # waited at first use
        "reduce_scatter": funcol.reduce_scatter_single(t, "sum", 0, pg).wait(),
        "all_to_all": funcol.all_to_all_single(t, [2, 2], [2, 2], pg).wait(),
        "broadcast": funcol.broadcast(t, 1, pg).wait(),
        "coalesced": [x.wait() for x in funcol.all_reduce_coalesced([t, t * 2], "sum", pg)],
    }
    values["c10d_seq"] = _c10d_seq()
    handle.remove()
    ch.uninstrument()
    return seen, values


def test_functional_collectives_are_recorded_with_c10d_sequence_numbers_and_their_results_unchanged(run_ranks):
    results = run_ranks(functional_ops, 2)
    (seen0, values0), (seen1, values1) = results
    assert [s[:3] for s in seen0] == [s[:3] for s in seen1]
    ops = [op for op, *_ in seen0]
    assert ops == ["all_reduce", "all_gather_into_tensor", "all_gather_into_tensor", "reduce_scatter_tensor",
                   "all_to_all_single", "broadcast", "all_reduce"]
    seqs = [seq for _, seq, *_ in seen0]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[-1] == values0["c10d_seq"]
    assert all(status == "ok" for _, _, status, *_ in seen0)
    by_op = {op: (nbytes, shapes) for op, _, _, nbytes, shapes in seen0[:6]}
    assert by_op["all_gather_into_tensor"][0] == 2 * 4 * 4  # the gathered output's bytes
    assert by_op["reduce_scatter_tensor"] == (4 * 4, [(2,)])
    assert seen0[6][4] == [(4,), (4,)]  # the coalesced all_reduce's two outputs

    base0, base1 = torch.arange(4.0), torch.arange(4.0) + 1
    for values in (values0, values1):
        assert torch.equal(values["all_reduce"], base0 + base1)
        assert torch.equal(values["all_gather"], torch.cat([base0, base1]))
        assert torch.equal(values["all_gather_dim1"], torch.cat([base0.view(2, 2), base1.view(2, 2)], 1))
        assert torch.equal(values["broadcast"], base1)
        assert torch.equal(values["coalesced"][1], 2 * (base0 + base1))
    assert torch.equal(values0["reduce_scatter"], (base0 + base1)[:2])
    assert torch.equal(values1["all_to_all"], torch.cat([base0[2:], base1[2:]]))


def _metric(text, name, **labels):
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = {k: str(v) for k, v in labels.items()}
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and want.items() <= sample.labels.items())


def dtensor_and_fsdp2(rank, world_size, base_port, trace_file):
    agent = commlens.agent.start(Config.from_env({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "COMMLENS_METRICS_ADDR": "127.0.0.1", "COMMLENS_METRICS_PORT": str(base_port), "COMMLENS_TRACE_FILE": trace_file,
        "COMMLENS_METRICS_DETAIL": "op"}))
    reader = ch.RingReader(ch.ring(), start=ch.ring().claimed())
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    replicated = sharded.redistribute(mesh, [Replicate()]).to_local()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
    grad_is_sharded = model[0].weight.grad.to_local().shape == (8 // world_size, 8)

    agent.sidecar.drain()
    records = [(r.kind, OPS[r.op].value, r.seq) for r in reader.read()]
    text = urllib.request.urlopen(f"http://127.0.0.1:{base_port + rank}/metrics", timeout=10).read().decode()
    metrics = {op: _metric(text, "commlens_collectives_total", op=op, rank=rank, status="ok")
               for op in ("all_gather_into_tensor", "reduce_scatter_tensor")}
    inflight = _metric(text, "commlens_collective_inflight", rank=rank)
    c10d_seq = _c10d_seq()
    commlens.agent.stop()
    return records, metrics, inflight, replicated, grad_is_sharded, c10d_seq


def test_a_dtensor_and_fsdp2_program_shows_every_collective_in_the_ring_and_the_metrics(run_ranks, tmp_path):
    for rank, (records, metrics, inflight, replicated, grad_is_sharded, c10d_seq) in enumerate(
            run_ranks(dtensor_and_fsdp2, 2, base_port=free_ports(2), trace_file=str(tmp_path / "spans-{rank}.jsonl"))):
        assert torch.equal(replicated, torch.arange(8.0)) and grad_is_sharded
        ends = [(op, seq) for kind, op, seq in records if kind == ch.END]
        seqs = sorted(seq for _, seq in ends)
        assert seqs == list(range(seqs[0], c10d_seq + 1)), "a collective c10d counted was not recorded"
        for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            assert metrics[op] == sum(1 for o, _ in ends if o == op) > 0, (rank, op, metrics, ends)
        assert inflight == 0


def never_waited(rank, world_size):
    from commlens.hooks import functional

    functional.PENDING_MAX = 8
    ch.instrument()
    before = ch.ring().errors()["work_unjudged"]
    outputs = [funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD) for _ in range(20)]
    pending, unjudged = len(functional._pending), ch.ring().errors()["work_unjudged"] - before
    ch.uninstrument()
    for output in outputs:
        output.wait()
    return pending, unjudged


def test_outputs_never_waited_for_are_let_go_past_a_bound_and_counted(run_ranks):
    for pending, unjudged in run_ranks(never_waited, 2):
        assert pending == 8 and unjudged == 12
