"""commlens changes nothing a program can see: same results, errors, objects and logging data.

PyTorch's own gloo distributed tests, each passing plain, must pass with commlens in every rank
(``pytorch_suite.py``); the rest checks, on real 2-rank gloo jobs, each way commlens could show.
"""

import copy
import io
import json
import os
import pickle
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import commlens.agent
import commlens.hooks as ch
from ports import free_ports
from commlens.hooks import poller, process_ring
from commlens.hooks.patch import PatchError

SUITE = [  # every one runs on gloo, CPU, 2 ranks
    # collectives and point-to-point, sync and async, and an error PyTorch raises for bad input
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_sum_complex", "test_all_reduce_max",
    "test_broadcast", "test_reduce_sum", "test_all_gather", "test_scatter", "test_gather", "test_barrier",
    "test_send_recv", "test_isend", "test_irecv", "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags",
    "test_sparse_all_reduce_sum", "test_all_reduce_coalesced_sum", "test_all_gather_coalesced_simple",
    "test_all_reduce_coalesced_max_complex_unsupported", "test_monitored_barrier_gloo",
    # object collectives
    "test_all_gather_object_default_pg", "test_scatter_object_list",
    # DDP on CPU
    "test_DistributedDataParallelCPU", "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad", "test_ddp_logging_data_cpu", "test_ddp_create_graph",
]


@pytest.fixture(scope="session")  # not module: a worker may run other modules' tests between the suite's
def suite(tmp_path_factory):
    """Each selected test's outcome with commlens in every rank, and the spans its ranks wrote. Every
    selected test passes on gloo without commlens (``python tests/pytorch_suite.py plain OUT.json NAME``
    says so for a test that fails here): the plain run is not repeated in every CI run, where it doubled
    the suite's 2.5 minutes."""
    tmp = tmp_path_factory.mktemp("suite")
    env = {**os.environ, "COMMLENS_METRICS_PORT": "0", "COMMLENS_TRACE_FILE": str(tmp / "traces-{rank}.jsonl")}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(variable, None)
    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "pytorch_suite.py"), "commlens",
                    str(tmp / "commlens.json"), *SUITE], env=env, cwd=tmp, check=True, timeout=1200,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    outcomes = json.loads((tmp / "commlens.json").read_text())
    spans = [json.loads(line) for rank in (0, 1) for line in (tmp / f"traces-{rank}.jsonl").read_text().splitlines()]
    return outcomes, spans


def ON_THE_SUITES_WORKER(test):
    """The tests that read the suite's run: on one pytest-xdist worker, so that it runs once, and
    first (it takes minutes)."""
    return pytest.mark.long(pytest.mark.xdist_group("pytorch-suite")(test))


@ON_THE_SUITES_WORKER
@pytest.mark.parametrize("name", SUITE)
def test_pytorchs_own_distributed_test_passes_under_commlens(suite, name):
    outcomes, _ = suite
    assert outcomes[name] == "passed", f"{outcomes[name]} (plain: python tests/pytorch_suite.py plain OUT.json {name})"


@ON_THE_SUITES_WORKER
def test_commlens_was_active_in_the_suites_ranks(suite):
    _, requests = suite
    names = {span["name"] for request in requests for rs in request["resourceSpans"]
             for ss in rs["scopeSpans"] for span in ss["spans"]}
    assert {"all_reduce", "broadcast", "send", "recv", "all_gather"} <= names


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))


def _step(model):
    model.zero_grad()
    model(torch.ones(4, 8) * (dist.get_rank() + 1)).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _error(action):
    try:
        action()
    except Exception as error:  # noqa: BLE001 — the error is what is compared
        return type(error).__name__, str(error).splitlines()[0]
    return None


def _int_hook(state, bucket):
    return 1


def _badly_annotated(state, bucket: int):
    return None


def ddp_as_seen_by_the_program(rank, world_size):
    """What a program sees of DDP, plain and then under ``instrument()``."""
    seen = {}
    for mode in ("plain", "commlens"):
        if mode == "commlens":
            ch.instrument()
        model = DDP(_model())
        errors = [_error(lambda: model.register_comm_hook(None, 1)),
                  _error(lambda: DDP(_model()).register_comm_hook(None, _badly_annotated))]
        bad = DDP(_model())
        bad.register_comm_hook(None, _int_hook)
        errors.append(_error(lambda: _step(bad)))
        grads = _step(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        copied = copy.deepcopy(model)
        hooked = DDP(_model())
        hooked.register_comm_hook(None, default_hooks.allreduce_hook)
        _step(hooked)
        builtin = DDP(_model())
        builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        seen[mode] = {
            "errors": errors, "grads": grads, "copied_grads": _step(copied), "builtin_grads": _step(builtin),
            "pickled": buffer.getvalue(), "hooked_pickle": pickle.dumps(hooked),
            "logging": {k: v for k, v in model._get_ddp_logging_data().items() if k in ("comm_hook", "bucket_sizes")},
            "hooked_logging": hooked._get_ddp_logging_data().get("comm_hook"),
            "hooks_held": [h.__qualname__ for h, _ in hooked._comm_hooks],
        }
    seen["buckets"] = len([r for r in ch.ring().snapshot() if r.kind == ch.START and r.aux > 0])
    ch.uninstrument()
    return seen


def test_ddp_under_commlens_raises_ddps_own_errors_and_pickles_copies_and_logs_as_without(run_ranks):
    for seen in run_ranks(ddp_as_seen_by_the_program, 2):
        plain, under = seen["plain"], seen["commlens"]
        assert plain["errors"][0] == ("TypeError", "Communication hook must be callable.")
        assert plain["errors"][1][0] == "ValueError" and plain["errors"][2][0] == "RuntimeError"
        assert under["errors"] == plain["errors"]
        for key in ("grads", "copied_grads", "builtin_grads"):
            for a, b in zip(plain[key], under[key]):
                torch.testing.assert_close(a, b)
        assert b"commlens" not in under["pickled"] and b"commlens" not in under["hooked_pickle"]
        assert under["logging"] == plain["logging"] and "comm_hook" not in plain["logging"]
        assert under["hooked_logging"] == plain["hooked_logging"] == "allreduce_hook"
        assert under["hooks_held"] == plain["hooks_held"] == ["allreduce_hook"]
        assert seen["buckets"] >= 3  # the hookless, copied and hooked models' buckets were recorded


def reduce_scatter_works_without_future(rank, world_size):
    ch.instrument()
    done = []
    handle = ch.register_post_hook(lambda a: done.append((a.name.value, a.status)))
    out = torch.zeros(2)
    work = dist.reduce_scatter_tensor(out, torch.ones(2 * world_size), async_op=True)
    work.wait()
    waited = list(done)
    dropped = dist.reduce_scatter_tensor(out, torch.ones(2 * world_size), async_op=True)
    dist.barrier()  # the collective itself completes on every rank ...
    del dropped  # ... and the work is dropped unwaited: it cannot be judged
    after_drop = list(done)
    thread = poller.poller._thread
    idle = _cpu_ticks(thread.native_id)
    time.sleep(0.5)  # not synchronisation: the interval over which the poller's CPU time is measured
    idle = _cpu_ticks(thread.native_id) - idle
    handle.remove()
    ch.uninstrument()
    return {"waited": waited, "after_drop": after_drop, "pending": len(poller.poller._pending),
            "unjudged": process_ring.ring().errors()["work_unjudged"], "idle_ticks": idle}


def _cpu_ticks(tid):
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_async_reduce_scatter_completes_on_wait_and_the_poller_goes_idle(run_ranks):
    for r in run_ranks(reduce_scatter_works_without_future, 2):
        assert r["waited"] == [("reduce_scatter_tensor", "ok")]
        assert r["after_drop"][-2:] == [("reduce_scatter_tensor", "ok"), ("barrier", "ok")] or \
            ("reduce_scatter_tensor", "ok") in r["after_drop"][1:]
        assert r["pending"] == 0 and r["unjudged"] == 1
        assert r["idle_ticks"] <= 1  # clock ticks (10 ms) in 0.5 s: the poller sleeps


def spawned_rank_labels(rank, world_size, port):
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        os.environ.pop(variable, None)  # as in an mp.spawn job that passes rank= to init_process_group
    os.environ.update(COMMLENS_METRICS_PORT=str(port), COMMLENS_METRICS_ADDR="127.0.0.1",
                      COMMLENS_TRACE_FILE=os.devnull)
    agent = commlens.agent.start()
    try:
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{port + rank}/metrics").read().decode()
    finally:
        commlens.agent.stop()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    errors = {s.labels["kind"]: s.value for s in families["commlens_telemetry_errors"].samples
              if s.name.endswith("_total")}
    return {"labels": families["commlens_info"].samples[0].labels, "rank": agent.config.rank, "errors": errors}


def test_an_mp_spawn_job_is_labelled_by_its_process_group(run_ranks):
    results = run_ranks(spawned_rank_labels, 2, port=free_ports(2))
    for rank, r in enumerate(results):
        assert r["rank"] == rank
        assert r["labels"]["rank"] == str(rank) and r["labels"]["world_size"] == "2"
        assert r["labels"]["local_rank"] == str(rank)
        assert r["errors"] == {"hook": 0, "recorder": 0, "string_dropped": 0, "work_unjudged": 0, "gpu_pool_exhausted": 0,
                               "gpu_captured": 0, "fingerprint_unread": 0}


def sparse_nan(rank, world_size):
    ch.instrument()
    check = ch.NanCheckHook(mode="report").register_with_comm()
    values = torch.tensor([1.0, float("nan") if rank == 1 else 2.0])
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), values, (4,))
    csr = torch.tensor([[0.0, 1.0], [float("inf") if rank == 0 else 3.0, 0.0]]).to_sparse_csr()
    findings = []
    for t in (coo, csr):
        before = check.events
        try:
            dist.all_reduce(t)
        except Exception:  # noqa: BLE001 — gloo refuses some layouts; the check ran before the op
            pass
        findings.append(check.events - before)
    nans = [(r.seq, r.flags) for r in ch.ring().snapshot() if r.kind == ch.NAN]
    check.unregister()
    ch.uninstrument()
    return {"findings": findings, "nans": nans}


def test_nan_and_inf_in_sparse_tensors_are_reported(run_ranks):
    r0, r1 = run_ranks(sparse_nan, 2)
    assert r0["findings"] == [0, 1] and r1["findings"] == [1, 0]


def test_a_closure_wrapping_a_torch_function_is_instrumented_and_restored():
    original = dist.destroy_process_group

    def users_wrapper(*args, **kwargs):
        return original(*args, **kwargs)

    dist.destroy_process_group = users_wrapper
    c10d = dist.distributed_c10d
    saved = c10d.destroy_process_group
    c10d.destroy_process_group = users_wrapper
    try:
        ch.instrument()
        assert ch.is_instrumented() and users_wrapper.__code__.co_freevars == ("original",)
        ch.uninstrument()
        assert users_wrapper.__code__.co_name == "users_wrapper"
    finally:
        dist.destroy_process_group = c10d.destroy_process_group = saved


def test_instrument_is_all_or_nothing():
    c10d = dist.distributed_c10d
    saved, code = c10d.gather, c10d.all_reduce.__code__
    cell = c10d.all_reduce.__closure__[code.co_freevars.index("func")].cell_contents
    c10d.gather = torch.add  # something that cannot be patched in place
    try:
        with pytest.raises(PatchError, match=r"torch\.distributed\.gather.*nothing was instrumented"):
            ch.instrument()
        assert not ch.is_instrumented()
        assert c10d.all_reduce.__closure__[code.co_freevars.index("func")].cell_contents is cell
    finally:
        c10d.gather = saved
