"""Collectives on CUDA tensors: durations from the GPU, queueing told from execution, the NaN/Inf
check without a host synchronisation. One GPU, a world of one (NCCL, and gloo with CUDA tensors);
skipped, saying why, where there is no GPU."""

import datetime
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

import commlens.hooks as ch
from monitoring import TrainingJob, culprits, wait_for
from ports import free_port
from commlens.agent.sidecar import Sidecar
from commlens.hooks import cuda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                                reason="needs a CUDA GPU and NCCL (runs on the device machine)")


@pytest.fixture
def group(request):
    """A world of one on GPU 0, with the given backend, and a sidecar draining the ring."""
    backend = getattr(request, "param", "nccl")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60),
                            **({"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}))
    ch.instrument()
    seen = []
    sidecar = Sidecar(ch.ring(), rank=0, hang_threshold_s=60, on_collective=seen.append)
    sidecar.pollers.append(cuda.poll)
    sidecar.drain()  # what earlier tests left in the ring
    seen.clear()
    yield sidecar, seen
    ch.uninstrument()
    dist.destroy_process_group()


def _until(sidecar, seen, count, timeout_s=30.0, which=lambda c: True):
    """Drain until ``count`` collectives (of ``which``) have completed (the GPU finishes them on its own
    time); those."""
    ready = threading.Event()
    for _ in range(int(timeout_s * 1000)):
        sidecar.drain()
        if len(done := [c for c in seen if which(c)]) >= count:
            return done
        ready.wait(0.001)
    raise AssertionError(f"only {len(done)} of {count} collectives completed")


@pytest.mark.parametrize("group", ["nccl", "gloo"], indirect=True)
def test_durations_come_from_the_gpu_and_agree_with_cuda_events(group):
    sidecar, seen = group
    x = torch.randn(1 << 30 >> 2, device="cuda")  # 1 GiB: NCCL copies it; gloo copies it through the host
    out = torch.empty(x.numel(), device="cuda")
    collective = (lambda: dist.all_gather_into_tensor(out, x)) if dist.get_backend() == "nccl" else \
        (lambda: dist.all_reduce(x))
    for _ in range(3):  # warm up
        collective()
    torch.cuda.synchronize()
    _until(sidecar, seen, 3)
    seen.clear()
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record()
    collective()
    after.record()
    [c] = _until(sidecar, seen, 1)
    measured = before.elapsed_time(after) / 1e3
    recorded = (c.end_ns - c.gpu_start_ns) / 1e9
    assert c.gpu_start_ns >= c.start_ns and c.op in ("all_gather_into_tensor", "all_reduce")
    assert recorded == pytest.approx(measured, rel=0.10), (recorded, measured)


def test_a_collective_behind_a_long_kernel_shows_queueing_not_execution(group):
    sidecar, seen = group
    x = torch.randn(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    _until(sidecar, seen, 1)
    seen.clear()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the collective on the same stream
    dist.all_reduce(x)
    [c] = _until(sidecar, seen, 1)
    queue, execution = (c.gpu_start_ns - c.start_ns) / 1e9, (c.end_ns - c.gpu_start_ns) / 1e9
    assert queue > 0.02 and execution < queue / 10, (queue, execution)


def test_nan_on_the_gpu_is_reported_with_its_op_and_seq(group):
    sidecar, seen = group
    check = ch.NanCheckHook(mode="report").register_with_comm()
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x)
    x[3] = float("nan")
    dist.broadcast(x, 0)
    seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    y = torch.ones(8, device="cuda")
    y[0] = float("inf")
    dist.all_reduce(y)
    _until(sidecar, seen, 3)
    check.unregister()
    found = {(c.op, c.seq): (c.nan, c.inf) for c in seen}
    assert found[("broadcast", seq)] == (True, False)
    assert found[("all_reduce", seq + 1)] == (False, True)  # the C all_reduce's: its record written by the poll
    assert sum(1 for nan, inf in found.values() if nan or inf) == 2
    assert check.events == 2  # the hook is told of both


def test_a_ddp_training_step_under_commlens_adds_no_synchronisation(group):
    sidecar, seen = group
    check = ch.NanCheckHook(mode="report").register_with_comm()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).cuda())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 512, device="cuda")

    def step():
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        dist.all_reduce(x)

    for _ in range(3):  # DDP's first iterations rebuild buckets (which synchronises, commlens or not)
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    done = _until(sidecar, seen, 16)
    check.unregister()
    assert all(c.gpu_start_ns > 0 for c in done if c.op == "all_reduce")
    assert not any(c.nan or c.inf for c in done)


def test_a_collective_captured_in_a_cuda_graph_leaves_the_capture_whole_and_replays_right(group):
    """An all_reduce captured in a CUDA graph under commlens (hooks, NaN check): the capture completes,
    each replay gives the collective's result, and the collective is recorded once, at capture, and
    counted as captured (its replays are not seen)."""
    sidecar, seen = group
    check = ch.NanCheckHook(mode="report").register_with_comm()
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x)  # NCCL's communicator set up before the capture, as CUDA graphs need
    torch.cuda.synchronize()
    _until(sidecar, seen, 1)
    seen.clear()
    graph, out, captured = torch.cuda.CUDAGraph(), None, ch.ring().errors()["gpu_captured"]
    with torch.cuda.graph(graph):
        out = x * 3
        dist.all_reduce(out)
    for value in (1.0, 5.0):
        x.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(x, 3 * value))
    check.unregister()
    assert [c.op for c in _until(sidecar, seen, 1)] == ["all_reduce"]
    assert ch.ring().errors()["gpu_captured"] - captured == 1


def test_a_nan_in_a_ddp_gradient_is_reported_on_its_bucket_timed_on_the_gpu(group):
    """DDP's buckets are checked and timed on a side stream, off the backward pass's: a NaN in the
    input of the second step reaches every gradient, and that step's bucket, and only it, reports it;
    the gradients are what DDP gives without commlens."""
    sidecar, seen = group
    check = ch.NanCheckHook(mode="report").register_with_comm()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256).cuda())
    x = torch.randn(8, 256, device="cuda")
    model(x).square().sum().backward()
    expected = 2 * (model.module(x).T @ x).detach()  # d/dW of sum((xW^T + b)^2), in a world of one
    assert torch.allclose(model.module.weight.grad, expected, rtol=1e-4, atol=1e-3)
    model.zero_grad()
    x[0, 0] = float("nan")
    model(x).square().sum().backward()
    torch.cuda.synchronize()
    done = sorted(_until(sidecar, seen, 2, which=lambda c: c.bucket >= 0), key=lambda c: c.seq)
    check.unregister()
    assert [c.nan for c in done] == [False, True], done
    assert all(c.gpu_start_ns > 0 for c in done)


def test_a_capture_stays_whole_while_the_sidecar_polls_collectives_still_running(group):
    """The sidecar's thread polls the events of an all_reduce still running on another stream while the
    training thread captures a CUDA graph (CUDA's default, global capture mode, in which another thread's
    event query would invalidate the capture): the capture completes, the graph replays right, and the
    earlier all_reduce is recorded with its GPU times."""
    sidecar, seen = group
    x, y = torch.ones(1024, device="cuda"), torch.ones(1024, device="cuda")
    dist.all_reduce(y)  # NCCL's communicator set up before the capture
    torch.cuda.synchronize()
    _until(sidecar, seen, 1)
    seen.clear()
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(400_000_000)  # ~0.2 s: its all_reduce's end event stays pending through the capture
        dist.all_reduce(y)
    capturing, polled, stop = threading.Event(), threading.Event(), threading.Event()

    def poll():
        during = 0
        while not stop.is_set():
            cuda.poll()
            during += capturing.is_set()
            if during >= 3:
                polled.set()

    poller = threading.Thread(target=poll)
    poller.start()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = x * 3
            capturing.set()
            assert polled.wait(30)  # three polls while the capture is under way
    finally:
        stop.set()
        poller.join()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 3.0))
    [c] = _until(sidecar, seen, 1)
    assert c.op == "all_reduce" and c.end_ns > c.gpu_start_ns > 0


@pytest.mark.parametrize("fault, culprit, verdict", [
    ("late", 2, "late or missing: rank 2 "), ("nan", 0, "NaN/Inf entered on rank 0"), ("desync", 1, "desync: rank 1 "),
])
def test_three_ranks_on_one_gpu_diagnose_names_the_faulty_rank_and_only_it(tmp_path, fault, culprit, verdict):
    """gloo with CUDA tensors, three ranks sharing GPU 0 (one GPU cannot host two NCCL ranks), an
    ordinary DDP script with a fault written in, under ``commlens run``: ``commlens diagnose`` names the
    culprit alone from the ranks' endpoints while the job runs (its times and checks the GPU's) and from
    the job's files after."""
    extra = ["--device", "cuda", *(["--late-s", "60"] if fault == "late" else [])]
    with TrainingJob(tmp_path, 3, fault, rank=culprit, step=30, extra=extra) as training:
        endpoints = [f"http://{target}/metrics" for target in training.targets]

        def named() -> str | None:
            report = _diagnose("--metrics", *endpoints, "--window", "2")
            return report if verdict in report else None

        live = wait_for(named, f"{verdict!r} from the ranks' endpoints", timeout_s=120,
                        explain=lambda: training.log.read_text()[-3000:])
        if fault != "nan":  # the others hang until gloo's timeout; every rank's dump is written meanwhile
            wait_for(lambda: all((training.out / f"rank_{r}").exists() for r in range(3)), "every rank's dump")
    offline = _diagnose(str(training.out))
    for report in (live, offline):
        assert verdict in report and culprits(report) == {culprit}, report


def _diagnose(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "commlens.agent.cli", "diagnose", *args], capture_output=True,
                          text=True, timeout=60)
    return done.stdout + done.stderr
