"""The demo job: a small model trained by N gloo processes on CPU with every collective recorded.

Each rank averages its gradients with ``all_reduce`` (one flattened bucket per step) and the loss
with another; at the end every rank writes its flight-recorder dump and rank 0 runs PyTorch's
analyzer (``torchfrtrace``) on the folder. Faults can be injected to see what the dumps catch:

    desync:rank=R:step=S   rank R issues a broadcast where the others all_reduce
    size:rank=R:step=S     rank R receives the step's learning-rate broadcast into a larger tensor
    skip:rank=R:step=S     rank R stops at step S: it never joins that step's all_reduce
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from commlens.hooks import FlightRecorderHook, NanCheckHook, instrument, register_abort_hook

FAULTS = ("desync", "size", "skip")


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``kind:rank=R:step=S``, e.g. ``desync:rank=1:step=3``."""
        usage = f"--inject {text!r} is not accepted: use KIND:rank=R:step=S with KIND one of {', '.join(FAULTS)}"
        kind, _, rest = text.partition(":")
        fields = dict(part.partition("=")[::2] for part in rest.split(":") if part)
        if kind not in FAULTS or set(fields) != {"rank", "step"}:
            raise ValueError(usage)
        try:
            return cls(kind, int(fields["rank"]), int(fields["step"]))
        except ValueError:
            raise ValueError(usage) from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(rank: int, world_size: int, steps: int, out_dir: str, port: int, fault: Fault | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHCOMM_FR_DUMP_TEMP_FILE=os.path.join(out_dir, "rank_"))
    instrument()
    recorder = FlightRecorderHook(max_entries=3 * steps + 16).register_with_comm()
    NanCheckHook(mode="report").register_with_comm()
    register_abort_hook(lambda args: recorder.dump_file(rank))
    timeout = datetime.timedelta(seconds=5 if fault else 300)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    dist.broadcast(torch.nn.utils.parameters_to_vector(model.parameters()), src=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    try:
        for step in range(steps):
            lr = torch.tensor([0.05]) if not _hit(fault, "size", rank, step) else torch.tensor([0.05, 0.0])
            dist.broadcast(lr, src=0)
            optimizer.param_groups[0]["lr"] = float(lr[0])
            x = torch.randn(64, 32, generator=generator)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            optimizer.zero_grad()
            loss.backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            _average(grads, rank, step, fault)
            torch.nn.utils.vector_to_parameters(grads, [p.grad for p in model.parameters()])
            optimizer.step()
            dist.all_reduce(loss.detach())
        dist.barrier()
    except _Stopped:
        pass
    except RuntimeError as error:  # an injected fault timed out; the abort hook already dumped
        print(f"rank {rank}: {str(error).splitlines()[0]}", file=sys.stderr)
    finally:
        recorder.dump_file(rank)
        _wait_for_all_dumps(rank, world_size, timeout)
        dist.destroy_process_group()


class _Stopped(Exception):
    """The injected ``skip`` fault: this rank stops issuing collectives."""


def _wait_for_all_dumps(rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """Keep every rank's connections open until all have dumped, so that a stopped rank is seen
    as missing from a collective (a timeout) rather than as a closed connection."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"commlens/dumped/{rank}", "1")
    try:
        store.wait([f"commlens/dumped/{r}" for r in range(world_size)], timeout * 3)
    except RuntimeError:  # a rank died without dumping: nothing more to wait for
        pass


def _hit(fault: Fault | None, kind: str, rank: int, step: int) -> bool:
    return fault is not None and (fault.kind, fault.rank, fault.step) == (kind, rank, step)


def _average(grads: torch.Tensor, rank: int, step: int, fault: Fault | None) -> None:
    if _hit(fault, "skip", rank, step):
        raise _Stopped
    if _hit(fault, "desync", rank, step):
        dist.broadcast(grads, src=0)
    else:
        dist.all_reduce(grads)
    grads /= dist.get_world_size()


def run(world_size: int, steps: int, out_dir: str, fault: Fault | None = None) -> subprocess.CompletedProcess:
    """Train, write one dump per rank into ``out_dir``, and return torchfrtrace's run on it."""
    os.makedirs(out_dir, exist_ok=True)
    mp.start_processes(_train, args=(world_size, steps, out_dir, free_port(), fault), nprocs=world_size,
                       start_method="spawn")
    analyzer = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", out_dir]
    return subprocess.run(analyzer, capture_output=True, text=True)
