"""Runs a selection of PyTorch's own gloo CPU distributed tests, plain or with commlens in every rank.

The tests come from the installed wheel (``torch.testing._internal.distributed.distributed_test``)
and are driven the way PyTorch's ``test_distributed_spawn.py`` drives them: one spawned process per
rank, gloo, a file store. With ``commlens``, every rank process runs what a user of commlens runs:
``commlens.agent.start()`` right after ``init_process_group``: hooks, the NaN/Inf check (report
mode, the default), sidecar, flight recorder, exporters.

    python tests/pytorch_suite.py {plain,commlens} RESULTS.json TEST_NAME...

writes ``{test name: outcome}``: "passed", "skipped: why", "failed: the error's last line".
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import tempfile
import unittest

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="commlens-suite-"))

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

_FORKSERVER = torch.multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["torch", "torch.testing._internal.distributed.distributed_test", "torch._dynamo",
                                    "commlens.agent"])  # DDP imports dynamo: 2 s of CPU


class _RankProcess(_FORKSERVER.Process):
    """A rank forked from a server that imported torch and PyTorch's test module once: a fresh process,
    as spawn gives, without importing them again for each test (4 s of 2 cores a test). It runs with
    the environment the test has when it starts the rank (each test sets its own ``TEMP_DIR``), not
    the server's, and runs its exit handlers at the end as a spawned process would (a forked one ends
    with ``os._exit``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.environment = dict(os.environ)

    def run(self):
        os.environ.clear()
        os.environ.update(self.environment)
        try:
            super().run()
        finally:
            atexit._run_exitfuncs()


def _with_commlens() -> None:
    """In a rank process: start commlens after each ``init_process_group``, and stop it (flushing) at
    exit, as a user would."""
    import commlens.agent

    init = dist.init_process_group

    def init_process_group(*args, **kwargs):
        init(*args, **kwargs)
        commlens.agent.start()

    atexit.register(commlens.agent.stop)  # flush at exit, as ``commlens run`` does

    dist.init_process_group = init_process_group


class TestDistBackendForked(TestDistBackend, DistributedTest._DistTestBase):
    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        if os.environ.get("COMMLENS_SUITE_MODE") == "commlens":
            _with_commlens()
        super()._run(rank, test_name, file_name, pipe, **kwargs)

    def setUp(self):
        super().setUp()
        self._start_processes(_RankProcess)


def _outcome(result: unittest.TestResult) -> str:
    if result.failures or result.errors:
        text = (result.failures + result.errors)[0][1].strip().splitlines()
        return "failed: " + (text[-1] if text else "?")
    if result.skipped:
        return "skipped: " + result.skipped[0][1]
    return "passed"


def main(mode: str, out: str, names: list[str]) -> None:
    os.environ["COMMLENS_SUITE_MODE"] = mode
    outcomes = {}
    for name in names:
        result = unittest.TestResult()
        TestDistBackendForked(name).run(result)
        outcomes[name] = _outcome(result)
        print(f"{mode} {name}: {outcomes[name]}", file=sys.stderr, flush=True)
    with open(out, "w") as f:
        json.dump(outcomes, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
