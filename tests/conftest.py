"""Runs real multi-process jobs for the tests: ``run_ranks(fn, world_size, **kwargs)``."""

import datetime
import os
import pickle
import sys

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))

from ports import free_port  # noqa: E402
from commlens.hooks import distributed  # noqa: E402

# imported once for run_ranks' ranks (DDP's constructor imports dynamo: 2 s of CPU)
mp.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "commlens.agent"])


def pytest_sessionstart(session):
    """Build commlens' C++ extensions (the DDP hook; the forwarder of PyTorch's process-group hooks on
    torch >= 2.14) before any job, as ``commlens demo`` does: a job's ranks building them at once would
    skew their hang clocks."""
    distributed.build_extensions()


def pytest_collection_modifyitems(items):
    """The long tests first: the workers start them while the short ones fill in around them."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def _rank_main(rank, fn, world_size, port, result_dir, timeout_s, backend, environ, kwargs):
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable(all_threads=True)  # a rank that aborts says where each of its threads was
    os.environ.clear()  # the test's environment now, not the forkserver's when it started
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    if backend == "nccl":
        import torch

        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    everyone_here("initialized", rank, world_size)
    try:
        result = fn(rank, world_size, **kwargs)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(result_dir, f"result_{rank}"), "wb") as f:
        pickle.dump(result, f)


def everyone_here(point: str, rank: int, world_size: int) -> None:
    """Wait until every rank has come to ``point``, through the job's store: no collective, so that the
    groups' sequence numbers stay the tests' own.

    After a process group is created: a rank with nothing to do in it (returns, destroys it) would tear
    its side down while a peer is still connecting ("Connection closed by peer" in the peer's init)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.set(f"{point}/{rank}", "1")
    store.wait([f"{point}/{r}" for r in range(world_size)])


@pytest.fixture
def run_ranks(tmp_path):
    """Run ``fn(rank, world_size, **kwargs)`` in ``world_size`` processes (gloo; "nccl": one GPU
    each); return their results. The ranks are forked from a forkserver that imported torch and
    commlens once per worker (a spawned rank imported them again: ~2 s of CPU each), with the test's
    environment as it is at the call."""

    def run(fn, world_size, timeout_s=60, backend="gloo", **kwargs):
        mp.start_processes(_rank_main, args=(fn, world_size, free_port(), str(tmp_path), timeout_s, backend,
                                             dict(os.environ), kwargs), nprocs=world_size, start_method="forkserver")
        results = []
        for rank in range(world_size):
            with open(tmp_path / f"result_{rank}", "rb") as f:
                results.append(pickle.load(f))
        return results

    return run
