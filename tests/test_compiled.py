"""Compiled and C++-issued collectives on 2 gloo ranks. On torch >= 2.14 PyTorch's own process-group
hooks reach them, so every collective of a group is recorded exactly once, with c10d's sequence
numbers; before 2.14 they stay unreachable, as docs/hooks.md says."""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import commlens.agent
import commlens.hooks as ch
from commlens.agent import Config
from commlens.hooks import native

NATIVE = native.AVAILABLE


def _recording():
    """Every collective commlens completes from now on: (op, group, seq, status), and NaN flags."""
    seen = []
    handle = ch.register_post_hook(lambda a: seen.append((a.name.value, a.pre.pg_name, a.pre.seq, a.status)))
    return seen, handle


def _settled(seen, count, timeout_s=30):
    """Wait for async completions (futures, the poller) to reach ``count`` records."""
    deadline = time.monotonic() + timeout_s
    while len(seen) < count and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the completions, bounded: not synchronisation between ranks
    return list(seen)


class TensorParallel(torch.nn.Module):
    """Tensor-parallel style: column shard, all_gather, row shard, reduce_scatter, all_reduce."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.up = torch.nn.Linear(8, 8)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        h = funcol.all_gather_tensor(self.up(x), 1, self.group)
        h = funcol.reduce_scatter_tensor(self.down(torch.relu(h)), "sum", 0, self.group)
        return funcol.all_reduce(h, "sum", self.group)


def compiled_tensor_parallel(rank, world_size, dumps):
    os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"] = dumps
    ch.instrument()
    recorder = ch.FlightRecorderHook(max_entries=256).register_with_comm()
    seen, handle = _recording()
    torch.manual_seed(0)
    model = torch.compile(TensorParallel(dist.group.WORLD))
    x = torch.ones(4, 8) * (rank + 1)
    outputs = [model(x).sum().item() for _ in range(3)]
    issued = dist.group.WORLD._get_sequence_number_for_group()
    seen = _settled(seen, issued)
    handle.remove()
    recorder.dump_file(rank)
    ch.uninstrument()
    return {"seen": seen, "c10d_seq": issued, "outputs": outputs}


@pytest.mark.long
def test_a_compiled_tensor_parallel_forward_records_each_collective_once_with_c10d_sequence_numbers(run_ranks, tmp_path):
    (tmp_path / "dumps").mkdir()
    results = run_ranks(compiled_tensor_parallel, 2, dumps=str(tmp_path / "dumps" / "rank_"))
    first, second = results
    assert first["outputs"] == second["outputs"]
    if not NATIVE:  # docs/hooks.md: collectives in graphs compiled by torch.compile are not reachable before 2.14
        assert first["seen"] == [] and second["seen"] == []
        return
    seqs = [seq for _, _, seq, _ in first["seen"]]
    assert sorted(seqs) == list(range(1, first["c10d_seq"] + 1)), first["seen"]  # each once, none missing
    assert first["seen"] == second["seen"]
    ops = [op for op, _, _, _ in sorted(first["seen"], key=lambda s: s[2])]
    assert ops == ["all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"] * 3
    assert all(status == "ok" for *_, status in first["seen"])
    analyzer = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                               str(tmp_path / "dumps")],
                              capture_output=True, text=True, timeout=120)
    assert analyzer.returncode == 0 and "mismatch" not in (analyzer.stdout + analyzer.stderr).lower(), \
        analyzer.stdout + analyzer.stderr


def ddp_and_fsdp2_compiled(rank, world_size):
    ch.instrument()
    seen, handle = _recording()
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))  # construction: broadcasts from C++
    ddp(torch.ones(2, 8)).sum().backward()
    mesh = init_device_mesh("cpu", (world_size,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = torch.compile(model)
    for _ in range(2):
        compiled(torch.ones(2, 8) * (rank + 1)).sum().backward()
    issued = {name: pg._get_sequence_number_for_group() for pg, name in dist.distributed_c10d._world.pg_names.items()}
    count = sum(issued.values())
    seen = _settled(seen, count)
    handle.remove()
    ch.uninstrument()
    return {"seen": seen, "issued": issued}


def test_ddp_and_a_compiled_fsdp2_model_record_every_collective_of_every_group_once(run_ranks):
    first, second = run_ranks(ddp_and_fsdp2_compiled, 2)
    for result in (first, second):
        for group, issued in result["issued"].items():
            seqs = sorted(seq for _, pg, seq, _ in result["seen"] if pg == group)
            if NATIVE:
                assert seqs == list(range(1, issued + 1)), (group, issued, seqs)
            else:  # DDP's construction-time broadcasts are issued from C++: not reachable before 2.14
                assert len(seqs) == len(set(seqs)) and len(seqs) < issued
    assert sorted(first["seen"], key=lambda s: (s[1], s[2])) == sorted(second["seen"], key=lambda s: (s[1], s[2]))


def compiled_nan_and_late_rank(rank, world_size):
    config = Config(rank=rank, world_size=world_size, hang_threshold_s=1.0, metrics_port=None,
                    trace_file=os.devnull, drain_interval_s=0.02)
    ch.instrument()
    group = dist.group.WORLD

    @torch.compile
    def step(x):
        return funcol.all_reduce(x * 1, "sum", group) + 0

    x = torch.ones(4)
    step(x)  # compiled by each rank at its own pace: on a busy machine one can be seconds behind the other,
    dist.barrier()  # so they meet before the hang watchdog starts, and only the fault below makes one wait
    agent = commlens.agent.start(config)
    if rank == 1:
        x[0] = float("nan")
    step(x)
    if rank == 1:
        time.sleep(3)  # the fault: rank 1 is late by 3 s for the next collective; rank 0 waits in it
    step(torch.ones(4))
    agent.sidecar.drain()
    stats = agent.sidecar.stats
    result = {"nans": dict(stats.nans), "first": dict(stats.first_nonfinite), "hangs": dict(stats.hangs)}
    commlens.agent.stop()
    return result


@pytest.mark.skipif(not NATIVE, reason="compiled collectives are reachable from torch 2.14 on (process-group hooks)")
def test_the_nan_check_and_the_hang_watchdog_see_compiled_collectives(run_ranks):
    first, second = run_ranks(compiled_nan_and_late_rank, 2)
    assert second["first"] == {("0", "nan"): (3, "all_reduce")}  # its input held NaN at seq 3 (2: the barrier)
    assert first["first"] == {} and second["nans"][("all", "0", "nan")] == 1  # op folded: the default detail
    assert first["hangs"] == {("all", "0"): 1}  # rank 0 waited past the threshold in seq 4
    assert second["hangs"] == {}


def beside_pytorch_hooks(rank, world_size):
    os.environ["TORCH_DIST_NAN_CHECK"] = "1"  # PyTorch attaches its NanCheckHook to groups made from now on
    group = dist.new_group(list(range(world_size)))
    import torch._C._distributed_c10d as c10d_native

    pytorch_recorder = c10d_native.FlightRecorderHook.attach(group)
    ch.instrument()
    seen, handle = _recording()
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    dist.all_reduce(t, group=group)
    t[0] = float("nan")  # on every rank: PyTorch's NaN check refuses it everywhere, so none waits
    try:
        dist.all_reduce(t, group=group)
        refused = None
    except RuntimeError as error:
        refused = str(error)

    @torch.compile
    def step(x):
        return funcol.all_reduce(x * 1, "sum", group) + 0

    try:  # every rank's input holds NaN: PyTorch's NaN check refuses the compiled collective everywhere
        step(torch.full((4,), float("nan")))
        compiled_refused = False
    except RuntimeError:
        compiled_refused = True
    step(torch.ones(4))
    seen = _settled(seen, 5)
    import pickle

    theirs = [(e["profiling_name"], e["collective_seq_id"])
              for e in pickle.loads(c10d_native._dump_fr_trace(True, False))["entries"]]
    handle.remove()
    ch.uninstrument()
    pytorch_recorder.remove()
    return {"seen": seen, "theirs": theirs, "refused": refused, "compiled_refused": compiled_refused}


@pytest.mark.skipif(not NATIVE, reason="PyTorch's own process-group hooks come with torch 2.14")
def test_pytorch_own_flight_recorder_and_nan_check_work_beside_commlens_and_nothing_is_counted_twice(run_ranks):
    first, second = run_ranks(beside_pytorch_hooks, 2, timeout_s=20)
    for result in (first, second):
        assert result["refused"] and "NaN" in result["refused"]  # PyTorch's NaN check raised, as without commlens
        assert result["compiled_refused"]
        # once each; the refused compiled collective failed (its post-hook never came), not left in flight
        assert [s[2:] for s in result["seen"]][:3] == [(1, "ok"), (2, "ok"), (3, "error")]
        assert sorted(s[3] for s in result["seen"][3:]) == ["error", "ok"], result["seen"]
        # theirs too: its hook names entries "c10d:<op>" before torch 2.15, "<backend>:<op>" from 2.15 on
        mine = "gloo:" if torch.__version__ >= (2, 15) else "c10d:"
        assert [seq for name, seq in result["theirs"] if name.startswith(mine)][:3] == [1, 2, 3], result["theirs"]


def hooks_registered_on_first_use(rank, world_size, cache, compiler):
    """instrument() in a process whose cache is ``cache``, with ``compiler`` as the C++ compiler; a DDP
    model's construction (broadcasts issued from C++) and eager all_reduces."""
    import warnings

    os.environ["XDG_CACHE_HOME"], os.environ["CXX"] = cache, compiler
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ch.instrument()
    seen, handle = _recording()
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))  # reaches commlens only through PyTorch's hooks
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)  # recorded by the wrapper: PyTorch's hooks step aside
    issued = dist.group.WORLD._get_sequence_number_for_group()
    seen = _settled(seen, issued)
    handle.remove()
    ch.uninstrument()
    return {"seen": seen, "issued": issued, "warnings": [str(w.message) for w in caught],
            "cached": sorted(name for name in os.listdir(os.path.join(cache, "commlens")) if name.endswith(".so"))
            if os.path.isdir(os.path.join(cache, "commlens")) else []}  # not the build's lock files


def _each_collective_once(result):
    assert sorted(seq for _, _, seq, _ in result["seen"]) == list(range(1, result["issued"] + 1)), result["seen"]
    ops = [op for op, _, _, _ in sorted(result["seen"], key=lambda s: s[2])]
    assert ops[-3:] == ["all_reduce"] * 3 and "broadcast" in ops[:-3], ops  # DDP checks shapes with an all_gather too


@pytest.mark.skipif(not NATIVE, reason="PyTorch's own process-group hooks come with torch 2.14")
def test_the_hooks_are_built_for_this_torch_on_first_use_and_record_every_collective_once(run_ranks, tmp_path):
    first, second = run_ranks(hooks_registered_on_first_use, 2, timeout_s=300, cache=str(tmp_path / "cache"),
                              compiler=os.environ.get("CXX", "c++"))
    for result in (first, second):
        assert result["warnings"] == []
        assert [name.rsplit("_", 1)[0] for name in result["cached"]] == ["commlens_ddp_hook", "commlens_pg_hooks"]
        _each_collective_once(result)
    assert first["seen"] == second["seen"]


@pytest.mark.skipif(not NATIVE, reason="PyTorch's own process-group hooks come with torch 2.14")
def test_without_a_compiler_the_hooks_are_registered_from_python_with_a_warning_and_record_the_same(run_ranks,
                                                                                                   tmp_path):
    first, second = run_ranks(hooks_registered_on_first_use, 2, timeout_s=120, cache=str(tmp_path / "cache"),
                              compiler="false")
    for result in (first, second):
        warned = result["warnings"]  # the DDP hook is built too (test_ddp.py: without it)
        assert len(warned) == 2 and [w for w in warned if "C++ forwarder could not be built" in w]
        assert [w for w in warned if "C++ hook could not be built" in w]
        for warning in warned:
            assert "C++ compiler and ninja" in warning and "\n" not in warning  # one line
        assert result["cached"] == []
        _each_collective_once(result)
