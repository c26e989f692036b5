"""The pod sidecar, end to end: a 4-rank gloo job of an ordinary training script under
``commlens run --ring-dir`` (the ranks run only the hot path) beside ``commlens sidecar`` in its own
process, as the training and commlens containers of a Kubernetes pod. The sidecar reports what a
killed or frozen rank was doing from shared memory, and going away never disturbs training."""

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import time

from commlens.agent import pod as agent_pod
from commlens.agent.config import Config
from commlens.ring.dumps import DUMP_REASONS
from commlens.ring.layout import END
from commlens.ring.memory import Ring, ring_file

from monitoring import STARTUP_S, PodSidecar, TrainingJob, promtool, wait_for

WORLD, THRESHOLD_S = 4, 2


def _dirs(tmp_path):
    rings = tmp_path / "rings"
    rings.mkdir()
    return rings


def test_a_killed_rank_is_reported_in_its_collective_from_shared_memory(tmp_path):
    rings = _dirs(tmp_path)
    with TrainingJob(tmp_path, WORLD, "kill", rank=2, step=20, ring_dir=rings) as job, \
            PodSidecar(tmp_path, rings, job.out, THRESHOLD_S) as sidecar:
        wait_for(lambda: sidecar.by_rank("commlens_rank_up") == {r: 0.0 for r in range(WORLD)}, "every rank ended",
                 STARTUP_S)
        hung = wait_for(lambda: sidecar.by_rank("commlens_collective_hung_seq").get(2), "rank 2's hang")
        text = sidecar.text()
        inflight = sidecar.by_rank("commlens_collective_inflight")
        issued = sidecar.by_rank("commlens_collective_last_seq", state="enqueued")
        others = wait_for(lambda: _each_other_rank(sidecar, 2), "the others' view")
        snapshots = sidecar.samples("commlens_abort_snapshots_total")
        report = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", "--metrics",
                                 f"http://127.0.0.1:{sidecar.port}/metrics", "--window", "1"],
                                capture_output=True, text=True, timeout=60)
    assert job.process.returncode != 0
    # The collective it died in is the last it issued, and the others waited in it (hung) or failed in it,
    # or in the next, where its part of the one it died in had reached them already.
    # Rank 2 may also show the step's DDP bucket in flight: that work had completed, but its completion
    # callback was still waiting for the GIL when the process killed itself.
    died_in = issued[2]
    assert inflight[2] >= 1 and hung in (died_in, died_in - 1), (inflight, hung, issued)
    assert set(others.values()) <= {died_in, died_in + 1}, (others, died_in)
    assert snapshots[(("rank", "2"), ("reason", "exit"))] == 1
    assert f"killed or crashed: rank 2 in all_reduce (group 0, seq {int(died_in)})" in report.stdout, \
        report.stdout + report.stderr
    dump = pickle.loads((job.out / "rank_2").read_bytes())
    last = dump["entries"][-1]
    assert (last["state"], last["collective_seq_id"], last["profiling_name"]) == \
        ("started", died_in, "gloo:all_reduce")
    checked = promtool("check", "metrics", input=text)
    assert checked.returncode == 0 and not checked.stdout.strip() and not checked.stderr.strip(), checked
    analyzer = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(job.out)],
                              capture_output=True, text=True, timeout=120)
    assert analyzer.returncode == 0, analyzer.stdout + analyzer.stderr


def test_a_frozen_rank_is_reported_hung_and_trains_on_when_it_resumes(tmp_path):
    rings = _dirs(tmp_path)
    with TrainingJob(tmp_path, WORLD, "freeze", rank=1, step=20, steps=60, ring_dir=rings) as job, \
            PodSidecar(tmp_path, rings, job.out, THRESHOLD_S) as sidecar:
        frozen = wait_for(job.fault_at, "the freeze")
        pid = Ring.attach(ring_file(str(rings), 1)).pid
        try:
            hung = wait_for(lambda: sidecar.by_rank("commlens_collective_hung_seq").get(1), "rank 1's hang")
            wait_for(lambda: time.time() > frozen + THRESHOLD_S + 5, "threshold + 5 s of the freeze")
            state = _process_state(pid)
            up = sidecar.by_rank("commlens_rank_up")
            still = sidecar.by_rank("commlens_collective_hung_seq")
        finally:  # on a failure too: a stopped rank outlives the job's teardown (torchrun's SIGTERM waits)
            os.kill(pid, signal.SIGCONT)
        assert job.wait(120) == 0
        wait_for(lambda: sidecar.by_rank("commlens_rank_up") == {r: 0.0 for r in range(WORLD)}, "every rank ended")
        after = sidecar.by_rank("commlens_collective_hung_seq")
        completed = sidecar.by_rank("commlens_collectives_total", op="all", status="ok")  # the default detail
    assert state == "T" and up[1] == 1  # stopped, and alive
    assert still[1] == hung and set(still) == set(range(WORLD)), still  # the others wait for it meanwhile
    assert after == {} and min(completed.values()) >= 60, (after, completed)


def test_a_sidecar_told_to_stop_before_its_ranks_writes_each_ranks_last_snapshot(tmp_path):
    """A pod's containers are told to stop together, and ``commlens run``'s sidecar shares the job's
    process group: told first, the sidecar follows its ranks until they have ended, and writes the
    ``signal`` dump each asks for on its way down."""
    rings = _dirs(tmp_path)
    with TrainingJob(tmp_path, WORLD, "none", steps=100000, ring_dir=rings) as job, \
            PodSidecar(tmp_path, rings, job.out, THRESHOLD_S) as sidecar:
        wait_for(lambda: len(_counted(sidecar)) == WORLD and min(_counted(sidecar).values()) > 50, "training",
                 STARTUP_S)
        sidecar.process.send_signal(signal.SIGTERM)
        wait_for(lambda: "stopping once" in sidecar.log_text(), "the sidecar told to stop")
        os.killpg(job.process.pid, signal.SIGTERM)  # commlens run and torchrun: torchrun stops its ranks
        job.wait(60)
        assert sidecar.process.wait(60) == 0
    for rank in range(WORLD):
        dump = pickle.loads((job.out / f"rank_{rank}").read_bytes())
        assert "signal" in dump[DUMP_REASONS], (rank, dump[DUMP_REASONS])


def test_a_restarted_sidecar_resumes_counting_nothing_twice(tmp_path):
    rings = _dirs(tmp_path)
    with TrainingJob(tmp_path, WORLD, "none", steps=400, ring_dir=rings) as job:
        with PodSidecar(tmp_path, rings, job.out, THRESHOLD_S) as first:
            before = wait_for(lambda: _counted(first) if min(_counted(first).values(), default=0) > 100 else None,
                              "counting", STARTUP_S)
            first.process.kill()
            first.process.wait()
        with PodSidecar(tmp_path, rings, job.out, THRESHOLD_S, port=first.port) as second:
            assert job.wait(120) == 0
            wait_for(lambda: second.by_rank("commlens_rank_up") == {r: 0.0 for r in range(WORLD)}, "every rank ended")
            after = _counted(second)
    written = {r: sum(1 for record in Ring.attach(ring_file(str(rings), r)).snapshot() if record.kind == END)
               for r in range(WORLD)}
    for r in range(WORLD):
        assert 0 < after[r] < written[r] and before[r] + after[r] <= written[r], (before, after, written)
        assert written[r] - (before[r] + after[r]) < written[r] / 4, (before, after, written)  # resumed near the kill


def test_a_rank_that_stops_and_starts_commlens_again_is_up_again(tmp_path):
    config = dataclasses.replace(Config.from_env({}), metrics_port=None, trace_file=str(tmp_path / "spans.jsonl"))
    ring = Ring(slots=64, path=ring_file(str(tmp_path), 0))
    ring.describe({"rank": 0, "local_rank": 0, "world_size": 1, "job": "test"})
    pod = agent_pod.PodSidecar(config, str(tmp_path))
    seen = []
    for step in (None, ring.close, ring.open, ring.close):
        if step is not None:
            step()
        pod.poll()
        seen.append(pod.feeds[0].alive)
    pod.stop(timeout_s=5)
    assert seen == [True, False, True, False]
    assert pod.feeds[0].pipeline.stats.snapshots["exit"] == 0  # closed cleanly each time: no dump


def _each_other_rank(sidecar: PodSidecar, culprit: int) -> dict[int, float] | None:
    """The seq each rank but ``culprit`` hung in, or failed in; None until every one has one."""
    hung, failed = (sidecar.by_rank(f"commlens_collective_{state}_seq") for state in ("hung", "failed"))
    view = {r: hung.get(r, failed.get(r)) for r in range(WORLD) if r != culprit}
    return None if None in view.values() else view


def _counted(sidecar: PodSidecar) -> dict[int, float]:
    found: dict[int, float] = {}
    for key, value in sidecar.samples("commlens_collectives_total").items():
        rank = int(dict(key)["rank"])
        found[rank] = found.get(rank, 0) + value
    return found


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
