"""An ordinary training script in one of five parallel layouts, with a fault written into any rank, for
the verdict matrix (``bench/detection.py --matrix``). It knows nothing of commlens: the matrix runs it
under ``commlens run -- torchrun``.

    torchrun --nproc-per-node 8 matrix_train.py --layout tp-pp-dp --fault nan --rank 6 --step 20

Layouts (``rank = replica * stages * tp + stage * tp + tp_index``; every rank creates every group, in
one order, before training):

    ddp       one data-parallel group, the world (DDP)
    fsdp      the model fully sharded over the world (FSDP2's ``fully_shard``: its parameters
              all_gathered forward and backward, its gradients reduce_scattered)
    tp-dp     tensor-parallel pairs (0, 1), (2, 3), ...: each rank holds a shard and the pair
              all_reduces its partial results; data-parallel over the pairs (DDP in the groups of
              the even and of the odd ranks)
    tp-pp-dp  TP 2 x PP 2 x DP world/4: each stage a TP pair that all_reduces its partial results
              forward and its input gradients backward; the stages exchange activations forward and
              gradients backward (``isend``/``irecv`` between the ranks of one TP index in consecutive
              stages) in a 1F1B schedule over ``--microbatches``; the gradients all_reduced over the
              replicas (an explicit all_reduce in the data-parallel groups)
    pp4       a pipeline of 4 stages of one rank each, x DP world/4 (as tp-pp-dp, without TP)

Every layout all_reduces the loss over the whole job every 10 steps (pipeline stages but the last
give 0).

``--precision``: fp32; bf16 (``torch.autocast`` on the CPU in bfloat16: activations, partial results
and the gradients sent back are bfloat16); fp16 (autocast in float16 with dynamic loss scaling,
``torch.amp.GradScaler`` growing its scale every few steps as ``parallel_train.py --amp`` does: the
scaled gradients overflow every few steps and the step is skipped; the ranks of one model replica
agree on the overflow through an all_reduce of their found-Inf flags, as Megatron's does).
``--params bf16`` (ddp): the model itself in bfloat16, its data too, so that DDP's gradient buckets are
bfloat16 (autocast keeps float32 parameters and gradients).

``--slow-start R``: rank R, healthy, builds its model ``--slow-start-s`` (5) after the others have
begun training, whatever the fault (a rank reading its checkpoint from a slower disk): the job's
start-up, the others waiting for it in their first ops.

Faults, on rank ``--rank`` at step ``--step`` (``--fault none`` for a healthy run):

    nan, inf      the rank puts NaN (Inf) in a tensor it then sends on: in a pipeline, into the
                  gradient it sends back to the previous stage, or, in the first stage, into the
                  activations it sends forward; in ddp into its own gradient, in tp-dp into its
                  partial result, before their all_reduce; in fsdp into its forward's output, whose
                  gradients it then reduce_scatters. The values then spread as they would.
    late          the rank sleeps ``--late-s`` before its first collective of the step
    stall         the same for 1.5 s, once (under a 3 s hang threshold)
    leave         the rank leaves the training loop and exits 0 without destroying the process group
    kill          the rank SIGKILLs itself right after issuing an async collective of its TP group
                  (of its data-parallel group where it has no TP partner; fsdp: the world's)
    size          the rank gives the job's loss all_reduce (the first from ``--step`` on) 2 elements
                  where the others give 1
    desync        the rank issues all_gather where the others all_reduce the job's loss
    slow-data     the rank's data loading takes ``--slow-ms`` longer every step from ``--step`` on
    slow-compute  the rank's forward does extra matmuls, ~``--slow-ms`` more every step from ``--step`` on
    corrupt       from ``--step`` on, one exponent bit of one element of the rank's gradients flips in the
                  result of their data-parallel all_reduce (a transfer corrupted silently: in DDP's
                  layouts a communication hook every rank registers; in the pipelines' after the explicit
                  all_reduce). Not in fsdp, whose gradients are reduce_scattered (no two ranks hold the same)
    grow          from ``--step`` on, the rank's gradients grow x1e3 (its loss scaled: a rank computing
                  wrong). In ddp only, whose DDP buckets' scale commlens follows
    flip          at ``--step``, once, the high bit of the exponent of the rank's largest gradient value
                  flips before DDP's all_reduce (memory or a unit gone wrong past ECC): 2^128 times a
                  value under 1. In ddp only; the job clips its gradients' norm, so it trains on. The
                  matrix runs it on a bfloat16 model (``--params bf16``)

In ddp the job clips its gradients' norm to 1, as large models' training does.

The wall time at which the fault strikes goes to ``FAULT_TIME_FILE`` (``faulty_train.mark_fault_time``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time

import torch
import torch.distributed as dist
from faulty_train import mark_fault_time
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import fully_shard

HIDDEN, BATCH = 32, 16
SHAPES = {"ddp": (1, 1, 0), "fsdp": (1, 1, 0), "tp-dp": (2, 1, 2), "tp-pp-dp": (2, 2, 4), "pp4": (1, 4, 4)}
"""Layout -> (TP size, pipeline stages, ranks per data-parallel replica; 0: any world)."""
FAULTS = ("none", "nan", "inf", "late", "stall", "leave", "kill", "size", "desync", "slow-data", "slow-compute",
          "corrupt", "grow", "flip")


class Fault:
    """This rank's fault ("none" unless it is the culprit); the first time it strikes is noted."""

    def __init__(self, args, rank: int):
        self.name = args.fault if rank == args.rank else "none"
        self.step, self.struck = args.step, False
        self.sleep_before_next = 0.0
        """Seconds a late or stalled rank sleeps before its next collective."""

    def now(self, name: str, step: int, every_step: bool = False) -> bool:
        """Whether fault ``name`` strikes at ``step`` (at ``--step``; from it on if ``every_step``)."""
        hit = self.name == name and (step >= self.step if every_step else step == self.step)
        if hit and not self.struck:
            self.struck = True
            mark_fault_time()
        return hit


class Comm:
    """The script's communication: every collective and point-to-point op goes through ``before``,
    where a late or stalled rank sleeps before its first one of the step."""

    def __init__(self, fault: Fault):
        self.fault = fault

    def before(self) -> None:
        if self.fault.sleep_before_next:
            time.sleep(self.fault.sleep_before_next)
            self.fault.sleep_before_next = 0.0

    def all_reduce(self, tensor, group=None, op=dist.ReduceOp.SUM, async_op=False):
        self.before()
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def isend(self, tensor, dst: int, group):
        self.before()
        return dist.isend(tensor.contiguous(), dst, group=group)

    def irecv(self, like, src: int, group):
        self.before()
        buffer = torch.empty_like(like)
        return buffer, dist.irecv(buffer, src, group=group)


class Shard(torch.nn.Module):
    """One rank's part of the model: a TP shard of a stage (the whole stage without TP)."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.dropout = dropout

    def forward(self, x):
        return self.linear(torch.nn.functional.dropout(torch.tanh(x), self.dropout, training=self.dropout > 0))


def poisoned(tensor, value: float):
    """A copy of ``tensor`` with one element ``value``."""
    tensor = tensor.detach().clone()
    tensor.view(-1)[0] = value
    return tensor


def flip_exponent_bit(tensor) -> None:
    """Flips an exponent bit of ``tensor``'s middle element in place (float32, or bfloat16: the same bit of
    its exponent): a small gradient becomes about 1e-20 of itself, a silent change."""
    bits = torch.int32 if tensor.dtype == torch.float32 else torch.int16
    tensor.view(-1)[tensor.numel() // 2:].view(bits)[0] ^= 1 << (29 if bits == torch.int32 else 13)


def flipped_high(tensor):
    """A copy of ``tensor`` whose largest value has its exponent's high bit flipped (float32 or bfloat16):
    2^128 times that value if under 1."""
    assert tensor.dtype in (torch.float32, torch.bfloat16), tensor.dtype
    bits = torch.int32 if tensor.dtype == torch.float32 else torch.int16
    tensor = tensor.detach().clone()
    largest = int(tensor.abs().argmax())
    tensor.view(-1)[largest:].view(bits)[0] ^= 1 << (30 if bits == torch.int32 else 14)
    return tensor


def burn(ms: float) -> None:
    """Matmuls for ``ms`` milliseconds: extra compute."""
    end, a = time.perf_counter() + ms / 1000, torch.randn(64, 64)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def start_late(world: int, rank: int, slow: int, seconds: float, timeout_s: float) -> None:
    """``--slow-start``: every rank but ``slow`` says that it begins training; ``slow`` waits until all
    have, then ``seconds`` more, however long their own start-up took. Said through the job's store,
    outside the process group: nothing of it is recorded."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    if rank != slow:
        store.set(f"matrix-train/training-{rank}", "1")
        return
    store.wait([f"matrix-train/training-{other}" for other in range(world) if other != slow])
    time.sleep(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(SHAPES), default="ddp")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--params", choices=("fp32", "bf16"), default="fp32", help="the model's dtype (ddp)")
    parser.add_argument("--dropout", type=float, default=0.0, help="of the shard's input, each rank its own draw")
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=20, help="base compute time of a step")
    parser.add_argument("--microbatches", type=int, default=2, help="per step, in the pipeline layouts")
    parser.add_argument("--late-s", type=float, default=8)
    parser.add_argument("--slow-ms", type=float, default=60)
    parser.add_argument("--timeout-s", type=float, default=60, help="the backend's timeout")
    parser.add_argument("--slow-start", type=int, default=-1,
                        help="a rank, healthy, that builds its model --slow-start-s after the others (a slower disk)")
    parser.add_argument("--slow-start-s", type=float, default=5)
    args = parser.parse_args()
    if args.fault == "corrupt" and args.layout == "fsdp":
        parser.error("--fault corrupt corrupts the data-parallel all_reduce of gradients: fsdp has none "
                     "(its gradients are reduce_scattered); take ddp, tp-dp, tp-pp-dp or pp4")
    if args.params != "fp32" and (args.layout != "ddp" or args.precision != "fp32"):
        parser.error("--params bf16 makes a DDP model bfloat16 in place of autocast: take --layout ddp --precision fp32")
    if args.fault in ("grow", "flip") and args.layout != "ddp":
        parser.error(f"--fault {args.fault} changes a DDP model's gradients: take ddp")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    tp, stages, per_replica = SHAPES[args.layout]
    per_replica = per_replica or 1
    assert world % per_replica == 0, f"{args.layout} takes a multiple of {per_replica} ranks"
    replicas = world // per_replica
    replica, stage, tp_index = rank // per_replica, rank % per_replica // tp, rank % tp
    at = lambda r, s, t: r * per_replica + s * tp + t  # noqa: E731

    # every rank creates every group, in one order, at once
    tp_groups = {(r, s): dist.new_group([at(r, s, t) for t in range(tp)]) for r in range(replicas)
                 for s in range(stages)} if tp > 1 else {}
    pp_groups = {(r, t): dist.new_group([at(r, s, t) for s in range(stages)]) for r in range(replicas)
                 for t in range(tp)} if stages > 1 else {}
    dp_groups = {(s, t): dist.new_group([at(r, s, t) for r in range(replicas)]) for s in range(stages)
                 for t in range(tp)} if args.layout not in ("ddp", "fsdp") else {}
    mp_groups = {r: dist.new_group(list(range(r * per_replica, (r + 1) * per_replica))) for r in range(replicas)} \
        if args.precision == "fp16" and stages > 1 else {}
    tp_group = tp_groups.get((replica, stage))
    pp_group = pp_groups.get((replica, tp_index))
    dp_group = dp_groups.get((stage, tp_index))  # None: the world
    mp_group = mp_groups.get(replica, tp_group)  # the ranks of a replica, which agree on an overflow
    first, last = stage == 0, stage == stages - 1
    prev_rank, next_rank = at(replica, stage - 1, tp_index), at(replica, stage + 1, tp_index)

    if rank == args.slow_start:
        start_late(world, rank, args.slow_start, args.slow_start_s, args.timeout_s)
    fault, dtype = Fault(args, rank), {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    comm = Comm(fault)
    torch.manual_seed(stage * tp + tp_index)  # the replicas of a shard start alike
    params = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.params]
    shard = Shard(args.dropout).to(params)
    pipelined = stages > 1
    if args.layout == "fsdp":
        model = fully_shard(shard)
    else:
        model = shard if pipelined else torch.nn.parallel.DistributedDataParallel(shard, process_group=dp_group)
    if args.fault == "corrupt" and not pipelined:
        def corrupting(group, bucket):  # every rank's hook; the culprit's result corrupted from --step on
            def result(future):
                reduced = future.value()[0]
                if fault.now("corrupt", step, every_step=True):
                    flip_exponent_bit(reduced)
                return reduced
            return allreduce_hook(group, bucket).then(result)
        model.register_comm_hook(dp_group, corrupting)
    optimizer = torch.optim.SGD(shard.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", growth_factor=2.0 ** 4, backoff_factor=2.0 ** -4, growth_interval=3,
                                  enabled=args.precision == "fp16")
    scaler.scale(torch.zeros(()))  # its scale, in every stage (the last alone scales a loss)
    microbatches = args.microbatches if pipelined else 1
    data = torch.Generator().manual_seed(replica)  # a replica's TP ranks read the same data
    act = torch.empty(BATCH, HIDDEN, dtype=dtype or torch.float32)  # what the stages exchange
    compute_s = args.step_ms / 1000 / (2 * microbatches)

    if args.slow_start >= 0 and rank != args.slow_start:
        start_late(world, rank, args.slow_start, 0, args.timeout_s)
    for step in range(args.steps):
        if fault.now("leave", step):
            return  # out of the loop and the script, the process group left as it is
        if fault.now("late", step) or fault.now("stall", step):
            fault.sleep_before_next = args.late_s if fault.name == "late" else 1.5
        # data loading
        inputs = [torch.randn(BATCH, HIDDEN, generator=data).to(params) for _ in range(microbatches)]
        targets = [torch.randn(BATCH, HIDDEN, generator=data) for _ in range(microbatches)]
        if fault.now("slow-data", step, every_step=True):
            time.sleep(args.slow_ms / 1000)
        poison = float("nan") if fault.now("nan", step) else float("inf") if fault.now("inf", step) else None
        saved, losses = [], []

        def forward(mb: int, received):
            nonlocal poison
            x = (inputs[mb] if first else received).detach().requires_grad_(not first)
            time.sleep(compute_s)
            if fault.now("slow-compute", step, every_step=True):
                burn(args.slow_ms / microbatches)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                partial = model(x)
            if poison is not None and args.layout == "tp-dp":  # into its partial result
                partial, poison = partial + (poisoned(partial, poison) - partial.detach()), None
            if poison is not None and args.layout == "fsdp":  # its gradients follow
                partial, poison = partial + (poisoned(partial, poison) - partial.detach()), None
            if tp_group is not None:  # the pair's partial results summed; the identity backward
                total = partial.detach().clone()
                if fault.now("kill", step):
                    comm.all_reduce(total, tp_group, async_op=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                comm.all_reduce(total, tp_group)
                partial = partial + (total - partial.detach())
            loss = ((partial.float() - targets[mb]) ** 2).mean() / microbatches if last else None
            losses.append(loss)
            saved.append((x, partial, loss))
            out = partial.detach()
            if poison is not None and first and pipelined:  # into the activations it sends forward
                out, poison = poisoned(out, poison), None
            return out

        def backward(received):
            nonlocal poison
            x, y, loss = saved.pop(0)
            time.sleep(compute_s)
            hook = None
            if not pipelined:
                if poison is not None and args.layout == "ddp":  # into its own gradient, before DDP's all_reduce
                    value, poison = poison, None
                    hook = shard.linear.weight.register_hook(lambda grad: poisoned(grad, value))
                elif fault.now("flip", step) and args.layout == "ddp":
                    hook = shard.linear.weight.register_hook(flipped_high)
                if fault.now("kill", step):  # in DDP's place: as many elements as its gradients, then death
                    comm.all_reduce(torch.cat([p.detach().reshape(-1) for p in shard.parameters()]),
                                    dp_group, async_op=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                comm.before()  # in ddp, DDP's bucket all_reduce is the step's first collective (fsdp: a gather)
            if last:
                scaler.scale(loss * 1e3 if fault.now("grow", step, every_step=True) else loss).backward()
            else:
                y.backward(received)
            if hook is not None:
                hook.remove()
            if first:
                return None
            grad = x.grad
            if tp_group is not None:  # the input gradient is the sum of the shards'
                comm.all_reduce(grad, tp_group)
            if poison is not None:  # into the gradient it sends back
                grad, poison = poisoned(grad, poison), None
            return grad

        # the 1F1B schedule (Megatron's, not interleaved); with one stage, forward and backward
        warmup = min(stages - stage - 1, microbatches)
        for mb in range(warmup):
            received = None
            if not first:
                received, work = comm.irecv(act, prev_rank, pp_group)
                work.wait()
            out = forward(mb, received)
            if not last:
                comm.isend(out, next_rank, pp_group).wait()
        received = None
        if warmup < microbatches and not first:
            received, work = comm.irecv(act, prev_rank, pp_group)
            work.wait()
        for mb in range(warmup, microbatches):
            out = forward(mb, received)
            grad_out = None
            if not last:  # send forward, receive backward
                sent = comm.isend(out, next_rank, pp_group)
                grad_out, work = comm.irecv(act, next_rank, pp_group)
                sent.wait()
                work.wait()
            grad_in = backward(grad_out)
            if first:
                continue
            if mb == microbatches - 1:
                comm.isend(grad_in, prev_rank, pp_group).wait()
            else:  # send backward, receive forward
                sent = comm.isend(grad_in, prev_rank, pp_group)
                received, work = comm.irecv(act, prev_rank, pp_group)
                sent.wait()
                work.wait()
        for _ in range(warmup):
            grad_out = None
            if not last:
                grad_out, work = comm.irecv(act, next_rank, pp_group)
                work.wait()
            grad_in = backward(grad_out)
            if not first:
                comm.isend(grad_in, prev_rank, pp_group).wait()

        if pipelined:  # the gradients averaged over the replicas (DDP's work, in the other layouts)
            grads = [p.grad for p in shard.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if fault.now("kill", step):  # no TP partner: its data-parallel group's all_reduce, then death
                comm.all_reduce(flat, dp_group, async_op=True)
                os.kill(os.getpid(), signal.SIGKILL)
            comm.all_reduce(flat, dp_group)
            if fault.now("corrupt", step, every_step=True):
                flip_exponent_bit(flat)
            flat /= replicas
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if args.layout == "ddp":
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(shard.parameters(), 1.0)
        if scaler.is_enabled():
            if mp_group is not None:  # the replica's ranks agree on an overflow, or their scales part
                found = torch.tensor([0.0 if all(torch.isfinite(p.grad).all() for p in shard.parameters()) else 1.0])
                comm.all_reduce(found, mp_group, op=dist.ReduceOp.MAX)
                if found.item():
                    shard.linear.weight.grad.view(-1)[0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()

        if step % 10 == 0:  # the job's loss, for the log
            report = (sum(losses).detach().float() if last else torch.zeros(())).reshape(1)
            if fault.name in ("size", "desync") and step >= args.step and not fault.struck:
                fault.now(fault.name, args.step)  # the first loss all_reduce from --step on
                if fault.name == "size":
                    report = report.repeat(2)
                else:
                    comm.before()
                    dist.all_gather([torch.empty_like(report) for _ in range(world)], report)
                    continue
            comm.all_reduce(report)
            if rank == 0:
                print(f"step {step}: loss {report.item() / replicas:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
