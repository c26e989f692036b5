"""An ordinary parallel training script with a fault written into it, for the end-to-end verdict
tests: ranks in tensor-parallel pairs (0, 1), (2, 3), ...; a pipeline whose stages are the pairs, where
each rank sends its activations to its peer in the next stage (``isend``/``irecv`` in the groups of the
even and of the odd ranks: (0, 2) and (1, 3) in a job of 4); data-parallel over the pairs (DDP in other
groups of the same ranks); and the loss averaged over the whole job now and then. On several nodes of
2 ranks each, a pair is a node's.

It knows nothing of commlens: the tests run it under ``commlens run -- torchrun``.

    torchrun --nproc-per-node 4 parallel_train.py --fault late --rank 1 --step 30

Faults, on rank ``--rank`` at step ``--step`` (``--fault none`` for a healthy run):

    late     the rank sleeps ``--late-s`` seconds before its tensor-parallel all_reduce: its pair
             partner waits for it there, its peer in the other stage waits in ``recv`` for it, and
             the partner's peer in ``recv`` for the partner
    late-send  a rank of the first stage sleeps ``--late-s`` seconds before it sends its activations:
             its peer in the second stage waits in ``recv`` for it, the pair partner in the next
             step's tensor-parallel all_reduce, and the peer's partner waits for the peer there
    order    the rank issues the job's loss all_reduce before its pair's: it waits there for the
             others, its pair partner waits for it in the pair, and their data-parallel peers wait
             for them; every rank waits on another (a deadlock, until the backend's timeout)
    kill     the rank SIGKILLs itself inside its pair's all_reduce (issued, not completed): its
             partner's all_reduce fails, its peer in the other stage waits in ``recv`` for it
    size     the rank gives the job's loss all_reduce (the first from ``--step`` on) two elements where
             the others give one (a shape bug in one rank's code): gloo fails or aborts the ranks in it
    recv-first  a rank of the first stage receives from its peer in the second before it sends: both
             wait in ``recv`` on each other (a pipeline schedule's deadlock), and their pair partners
             wait for them in the next step's tensor-parallel all_reduce

``--amp``: mixed precision, the forward in float16 with dynamic loss scaling (``torch.amp.GradScaler``,
growing its scale every few steps): every few steps the scaled gradients overflow to Inf, the
gradient buckets of every rank hold it, and the scaler skips the step and lowers its scale. Healthy.
"""

import argparse
import datetime
import os
import signal
import time

import torch
import torch.distributed as dist
from faulty_train import mark_fault_time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default="none")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=30)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--step-ms", type=float, default=20, help="compute time of a step")
    parser.add_argument("--late-s", type=float, default=8)
    parser.add_argument("--amp", action="store_true", help="float16 forward, dynamic loss scaling")
    parser.add_argument("--timeout-s", type=float, default=60, help="the backend's timeout")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world >= 4 and world % 2 == 0, "tensor-parallel pairs, at least 2 stages"
    # every rank creates every group, in one order
    pairs = [dist.new_group([pair, pair + 1]) for pair in range(0, world, 2)]
    replicas = [dist.new_group(list(range(first, world, 2))) for first in (0, 1)]
    stages = [dist.new_group(list(range(first, world, 2))) for first in (0, 1)]
    tensor_parallel, data_parallel, pipeline = pairs[rank // 2], replicas[rank % 2], stages[rank % 2]
    first_stage, last_stage = rank < 2, rank >= world - 2
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64), process_group=data_parallel)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    scaler = torch.amp.GradScaler("cpu", growth_factor=2.0 ** 4, backoff_factor=2.0 ** -4, growth_interval=3,
                                  enabled=args.amp)
    for step in range(args.steps):
        if rank == args.rank and step == args.step and args.fault != "none":
            mark_fault_time()
        time.sleep(args.step_ms / 1000)
        with torch.autocast("cpu", dtype=torch.float16, enabled=args.amp):
            out = model(torch.randn(32, 64, generator=data)).float()
        shard = out.detach().clone()
        if rank == args.rank and step == args.step and args.fault == "late":
            time.sleep(args.late_s)
        if rank == args.rank and step == args.step and args.fault == "order":
            dist.all_reduce(torch.zeros(()))  # the job's loss all_reduce, too early (a step that has one)
        if rank == args.rank and step == args.step and args.fault == "kill":
            dist.all_reduce(shard, group=tensor_parallel, async_op=True)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(shard, group=tensor_parallel)  # the pair's partial results summed
        if not first_stage:
            received = torch.empty_like(shard)
            dist.irecv(received, rank - 2, group=pipeline).wait()
            shard = received  # this stage goes on from the previous stage's activations
        if not last_stage:  # the activations to the next stage, as a pipeline's schedule sends them
            if rank == args.rank and step == args.step and args.fault == "late-send":
                time.sleep(args.late_s)
            if rank == args.rank and step == args.step and args.fault == "recv-first":
                dist.irecv(torch.empty_like(shard), rank + 2, group=pipeline).wait()
            dist.isend(shard, rank + 2, group=pipeline).wait()
        loss = (out - shard / 2).pow(2).mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()  # DDP: the gradients all_reduced over the data-parallel group
        scaler.step(optimizer)
        scaler.update()
        if step % 10 == 0:
            total = loss.detach().clone()
            if rank == args.rank and args.step <= step < args.step + 10 and args.fault == "size":
                total = total.repeat(2)
            dist.all_reduce(total)  # the job's loss, for the log
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
