"""A rank that does not join a collective: the others' hang counters, spans and snapshots say so."""

import json
import os
import pickle
import shutil
import subprocess
import time
import urllib.request

import torch
import torch.distributed as dist

import commlens.agent
from commlens.agent import Config

THRESHOLD_S = 1.0


def _hangs_reported(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return any(line.startswith("commlens_hangs_total{") and not line.endswith(" 0.0") for line in text.splitlines())


def _shows_the_hang(path):
    """Whether the dump at ``path`` holds the 4th all_reduce, still started (a dump is renamed into place whole)."""
    try:
        with open(path, "rb") as f:
            entries = pickle.load(f)["entries"]
    except FileNotFoundError:
        return False
    return any(e["collective_seq_id"] == 4 and e["state"] == "started" for e in entries)


def late_rank(rank, world_size, base_port, folder):
    os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"] = os.path.join(folder, "dumps", "rank_")
    agent = commlens.agent.start(Config.from_env({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "COMMLENS_METRICS_ADDR": "127.0.0.1", "COMMLENS_METRICS_PORT": str(base_port),
        "COMMLENS_HANG_THRESHOLD_S": str(THRESHOLD_S), "COMMLENS_TRACE_FILE": os.path.join(folder, "spans-{rank}.jsonl")}))
    t = torch.ones(64)
    for _ in range(3):
        dist.all_reduce(t)
    if rank == 2:  # late: joins the 4th all_reduce only once both others report their hang
        deadline = time.monotonic() + 60
        while not all(_hangs_reported(base_port + r) for r in (0, 1)):
            assert time.monotonic() < deadline, "no hang reported by ranks 0 and 1 within 60 s"
            time.sleep(0.1)
        agent.snapshot("signal")  # what Kubernetes' SIGTERM would make it write
        # every rank's dump: ranks 0 and 1 in the hang, and rank 2's, taken before it joins (this
        # snapshot, or the one the others' hang asked for: a snapshot is skipped while another is written)
        dumps = os.path.join(folder, "dumps")
        while not (all(_shows_the_hang(os.path.join(dumps, f"rank_{r}")) for r in (0, 1))
                   and os.path.exists(os.path.join(dumps, "rank_2"))):
            assert time.monotonic() < deadline, "no dump from every rank within 60 s"
            time.sleep(0.1)
        # the dumps as they stood during the hang, which the operator analyses: the ranks' later
        # dumps, asked for by each other's hang (agent/job_dumps.py), may come once it has passed
        shutil.copytree(dumps, os.path.join(folder, "dumps-during-the-hang"), ignore=shutil.ignore_patterns(".*"))
    dist.all_reduce(t)
    hangs = dict(agent.sidecar.stats.hangs)
    commlens.agent.stop()
    return hangs


def _hang_spans(path):
    found = []
    with open(path) as f:
        for line in f:
            for resource_spans in json.loads(line)["resourceSpans"]:
                for scope_spans in resource_spans["scopeSpans"]:
                    for span in scope_spans["spans"]:
                        a = {kv["key"]: next(iter(kv["value"].values())) for kv in span["attributes"]}
                        if a.get("commlens.in_flight"):
                            found.append(a)
    return found


def test_the_waiting_ranks_name_the_stuck_collective_and_the_analyzer_names_the_late_rank(run_ranks, tmp_path):
    from ports import free_port

    base = free_port()
    hangs = run_ranks(late_rank, 3, base_port=base, folder=str(tmp_path))
    assert hangs[0] == {("all", "0"): 1} and hangs[1] == {("all", "0"): 1} and hangs[2] == {}  # op folded by default
    for rank in (0, 1):
        [span] = _hang_spans(tmp_path / f"spans-{rank}.jsonl")
        assert (span["commlens.op"], span["commlens.pg.name"], int(span["commlens.seq"])) == ("all_reduce", "0", 4)
        assert span["commlens.hang"] is True and THRESHOLD_S <= span["commlens.age_s"] <= THRESHOLD_S + 2
    verdict = subprocess.run(["torchfrtrace", str(tmp_path / "dumps-during-the-hang")], capture_output=True, text=True)
    assert "missing ranks: {2}" in verdict.stdout + verdict.stderr, verdict.stdout + verdict.stderr
