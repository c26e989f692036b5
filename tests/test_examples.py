"""The APIs commlens mirrors, used as their own pages and tests use them: torchcomms' hooks and flight
recorder (the blocks of docs/hooks.md, "Code written for torchcomms", run as written), a DDP communication
hook registered as PyTorch's ``test_ddp_hooks.py`` registers one, and PyTorch's ``ModTracker`` beside
commlens' module attribution."""

import contextlib
import io
import json
import os
import pathlib
import pickle
import re
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import DDPCommHookType, register_ddp_comm_hook
from torch.distributed._tools.mod_tracker import ModTracker
from torch.nn.parallel import DistributedDataParallel

import commlens.hooks as ch
from commlens.agent.sidecar import Sidecar
from commlens.hooks import attribution

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "hooks.md"


def example(number: int) -> str:
    """The ``number``-th Python block of docs/hooks.md's "Code written for torchcomms"."""
    section = DOC.read_text().split("## Code written for torchcomms", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[number]


def run_example(rank, world_size, number):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(example(number), f"docs/hooks.md example {number}", "exec"), {})
    after = []
    handle = ch.register_post_hook(lambda a: after.append(a.name.value))
    dist.all_reduce(torch.ones(2))  # the example's hooks are removed: they print no more
    handle.remove()
    ch.uninstrument()
    return printed.getvalue(), after


def test_torchcomms_hooks_example_runs_as_written_and_its_handles_remove_its_hooks(run_ranks):
    for printed, after in run_ranks(run_example, 2, number=0):
        assert re.fullmatch(r"Starting operation: OpName\.all_reduce \(op_id=(\d+)\)\n"
                            r"Completed operation: OpName\.all_reduce \(op_id=\1\)\n", printed), printed
        assert after == ["all_reduce"]


def test_torchcomms_flight_recorder_example_runs_as_written_and_dumps_where_torchcomms_does(run_ranks, tmp_path):
    os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"] = str(tmp_path / "fr_")
    try:
        results = run_ranks(run_example, 2, number=1)
    finally:
        del os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"]
    for rank, (printed, _) in enumerate(results):
        trace = json.loads(printed)
        ops = [(e["profiling_name"], e["state"]) for e in trace["entries"]]
        assert ops[-2:] == [("gloo:all_reduce", "completed"), ("gloo:barrier", "completed")], ops
        with open(tmp_path / f"fr_{rank}", "rb") as dump:  # the same entries, pickled as PyTorch's are
            assert [(e["collective_seq_id"], e["profiling_name"], e["state"]) for e in pickle.load(dump)["entries"]] \
                == [(e["collective_seq_id"], e["profiling_name"], e["state"]) for e in trace["entries"]]


def ddp_grads(rank, world_size, hook_name):
    """PyTorch's test_ddp_hooks.py: a model's gradients with the hook named ``hook_name`` registered by
    ``register_ddp_comm_hook``, without commlens and under it; the buckets commlens recorded."""
    hook_type = DDPCommHookType[hook_name] if hook_name else None

    class Task(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.p = torch.nn.Parameter(torch.randn(40, 20))

        def forward(self, x, rank):
            return self.p * x ** (1 + rank)

    def grads():
        model = DistributedDataParallel(Task())
        if hook_type is not None:
            register_ddp_comm_hook(comm_hook_type=hook_type, model=model, state=None)
        torch.manual_seed(2020)
        model(torch.randn(40, 20), rank).mean().backward()
        grad = next(model.parameters()).grad
        if hook_type is DDPCommHookType.NOOP:  # as PyTorch's test: the average, reduced after the hook
            grad.div_(world_size)
            dist.all_reduce(grad)
        return grad

    plain = grads()
    ch.instrument()
    buckets, reduced = [], threading.Event()
    expected = 2 if hook_type is DDPCommHookType.NOOP else 1  # the hook's bucket; NOOP's, and the all_reduce after

    def bucket_seen(a):  # an async bucket's post-hook runs from its work's future, maybe after backward returns
        if a.name.value == "all_reduce" and a.pre.tensors and a.pre.tensors[0].numel() == 800:
            buckets.append(a.status)
            if len(buckets) == expected:
                reduced.set()

    handle = ch.register_post_hook(bucket_seen)
    under = grads()
    assert reduced.wait(timeout=60), "no post-hook for the gradient bucket's all_reduce"
    handle.remove()
    ch.uninstrument()
    return plain, under, buckets


@pytest.mark.parametrize("hook_name", ["", "ALLREDUCE", "FP16_COMPRESS", "NOOP"])
def test_a_ddp_comm_hook_registered_as_pytorchs_own_tests_do_gives_their_gradients_under_commlens(run_ranks, hook_name):
    for plain, under, buckets in run_ranks(ddp_grads, 2, hook_name=hook_name):
        torch.testing.assert_close(under, plain, rtol=0, atol=0)  # the same hook, the same numbers
        assert sorted(buckets) == (["not_issued", "ok"] if hook_name == "NOOP" else ["ok"]), buckets


def tracked(rank, world_size):
    """ModTracker's example (its docstring) with a collective in the forward, as tensor parallelism issues
    one, under commlens' module attribution: both name the module."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x):
            y = self.linear(x)
            parents.append(set(tracker.parents))
            dist.all_reduce(y.detach().clone())
            return y

    ch.instrument()
    attribution.enable()
    collectives = []
    sidecar = Sidecar(ch.ring(), rank, hang_threshold_s=60, on_collective=collectives.append)
    sidecar.reader.cursor = ch.ring().claimed()
    parents = []
    mod = torch.nn.Sequential(Block())
    with ModTracker() as tracker:
        mod(torch.rand(2, 2))
    sidecar.drain()
    attribution.disable()
    ch.uninstrument()
    return parents, [(c.module, c.phase) for c in collectives]


def test_modtracker_and_module_attribution_both_name_the_module_a_collective_runs_in(run_ranks):
    for parents, modules in run_ranks(tracked, 2):
        assert parents == [{"Global", "Sequential", "Sequential.0"}], parents
        assert modules == [("0", "forward")], modules
