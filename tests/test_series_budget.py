"""The series budget: what one rank of a four-group job exposes at each ``COMMLENS_METRICS_DETAIL``."""

import urllib.request

import pytest
import torch
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families

import commlens.agent
from commlens.agent.config import Config
from ports import free_ports

from monitoring import promtool

BUDGET = 150
OPS_PER_GROUP = 17


def four_groups(rank, world_size, base_port, trace_file, detail):
    agent = commlens.agent.start(Config.from_env({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "COMMLENS_METRICS_ADDR": "127.0.0.1",
        "COMMLENS_METRICS_PORT": str(base_port), "COMMLENS_TRACE_FILE": trace_file, "COMMLENS_METRICS_DETAIL": detail}))
    for group in [None] + [dist.new_group([0, 1]) for _ in range(3)]:
        for nbytes in (256, 64 << 10, 4 << 20):  # three size classes
            t = torch.ones(nbytes // 4)
            dist.all_reduce(t, group=group)
            dist.broadcast(t, 0, group=group)
            dist.all_gather_into_tensor(torch.empty(2 * t.numel()), t, group=group)
            dist.reduce_scatter_tensor(torch.empty(t.numel() // 2), t, group=group)
            dist.all_to_all_single(torch.empty_like(t), t, group=group)
        dist.barrier(group=group)
        if rank == 0:
            dist.send(torch.ones(4), 1, group=group)
        else:
            dist.recv(torch.ones(4), 0, group=group)
    agent.sidecar.drain()
    text = urllib.request.urlopen(f"http://127.0.0.1:{base_port + rank}/metrics", timeout=10).read().decode()
    commlens.agent.stop()
    return text


def _samples(text):
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


@pytest.mark.parametrize("detail", ["group", "full"])
def test_a_four_group_job_stays_within_the_series_budget_by_default_and_shows_every_op_when_asked(
        run_ranks, tmp_path, detail):
    texts = run_ranks(four_groups, 2, base_port=free_ports(2), trace_file=str(tmp_path / "spans-{rank}.jsonl"),
                      detail=detail)
    for rank, text in enumerate(texts):
        samples = _samples(text)
        checked = promtool("check", "metrics", input=text)
        assert checked.returncode == 0 and not checked.stdout.strip() and not checked.stderr.strip(), checked
        completed = sum(s.value for s in samples if s.name == "commlens_collectives_total")
        timed = sum(s.value for s in samples if s.name == "commlens_collective_duration_seconds_count")
        assert completed == timed >= 4 * OPS_PER_GROUP  # folding loses no collective
        ops = {s.labels["op"] for s in samples if s.name == "commlens_collectives_total"}
        groups = {s.labels["pg"] for s in samples if s.name == "commlens_collectives_total"}
        assert len(groups) == 4 and all(s.labels["rank"] == str(rank) for s in samples)
        for s in samples:  # each histogram's +Inf bucket is its count, at every level
            if s.name == "commlens_collective_duration_seconds_bucket" and s.labels["le"] == "+Inf":
                count = next(c.value for c in samples if c.name == "commlens_collective_duration_seconds_count"
                             and {k: c.labels[k] for k in ("op", "pg", "size_class")} ==
                             {k: s.labels[k] for k in ("op", "pg", "size_class")})
                assert s.value == count
        if detail == "group":
            assert len(samples) <= BUDGET, len(samples)
            assert ops == {"all"}
        else:
            assert len(samples) > BUDGET
            assert {"all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                    "barrier", ("send", "recv")[rank]} <= ops
            sizes = {s.labels["size_class"] for s in samples if s.name.startswith("commlens_collective_duration")}
            assert {"<=4KiB", "<=64KiB", "<=16MiB"} <= sizes
