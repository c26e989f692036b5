"""An ordinary DDP training script with a fault written into it, for the end-to-end verdict tests.

It knows nothing of commlens: the tests run it under ``commlens run -- torchrun ...``.

    torchrun --nproc-per-node 3 faulty_train.py --fault late --rank 1 --step 5 --steps 400

Faults, all on rank ``--rank`` from step ``--step`` (``--fault none`` for a healthy run; several joined by
commas, ``inf,slow``, strike together):

    nan      a parameter holds NaN before backward
    inf      a tensor hook makes a gradient Inf, every step from then on
    late     the rank sleeps ``--late-s`` seconds before the step's first collective
    leave    the rank leaves the training loop (and ends)
    slow     the rank computes ``--slow-ms`` (30) longer every step
    desync   the rank issues all_gather where the others all_reduce
    kill     the rank SIGKILLs itself inside the step's last all_reduce (issued, not completed)
    freeze   the rank stops itself (SIGSTOP) inside that all_reduce, until it gets SIGCONT (the
             others come to it a second later: it cannot complete before the rank stops)

``--slow-start R``: rank R, healthy, takes ``--slow-start-s`` (5) longer to start than the others (a rank
reading its checkpoint from a slower disk), whatever the fault.

Under torchrun ``--max-restarts`` the fault strikes in the job's first attempt only, and each attempt
meets its peers under its own prefix of the job's store (on gloo, an attempt that finds the last one's
addresses there may connect to a rank gone). ``--device cuda``: the model and its tensors on GPU 0 (every
rank's: gloo with CUDA tensors, as one GPU cannot host two NCCL ranks). ``--amp``: mixed precision, the forward in float16 with dynamic loss scaling (``torch.amp.GradScaler``,
as ``parallel_train.py --amp``): healthy, the scaler skips a step now and then; with ``inf`` every step.

The wall time at which the fault happens is written to ``FAULT_TIME_FILE`` (when set), so that a
benchmark can measure how long detection takes.
"""

import argparse
import datetime
import os
import signal
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default="none")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--step-ms", type=float, default=20, help="compute time of a step")
    parser.add_argument("--late-s", type=float, default=8)
    parser.add_argument("--slow-ms", type=float, default=30)
    parser.add_argument("--slow-start", type=int, default=-1, help="a rank that starts --slow-start-s later")
    parser.add_argument("--slow-start-s", type=float, default=5)
    parser.add_argument("--amp", action="store_true", help="float16 forward, dynamic loss scaling")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model and its tensors live (cuda: gloo with CUDA tensors, every rank on GPU 0)")
    parser.add_argument("--timeout-s", type=float, default=60, help="the backend's timeout")
    parser.add_argument("--metrics", type=int, default=0,
                        help="every 10 steps, all_reduce this many scalar metrics at once, each its own async op")
    args = parser.parse_args()
    timeout = datetime.timedelta(seconds=args.timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")):  # torchrun's store, hosted by its agent
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store), timeout=timeout,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if rank == args.slow_start:
        time.sleep(args.slow_start_s)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(args.device, growth_factor=2.0 ** 4, backoff_factor=2.0 ** -4, growth_interval=3,
                                  enabled=args.amp)
    faults = set(args.fault.split(","))
    data = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        faulty = attempt == 0 and rank == args.rank and step >= args.step
        first = faulty and step == args.step
        if first:
            mark_fault_time()
        if faulty and "leave" in faults:
            break
        if first and "late" in faults:
            time.sleep(args.late_s)
        time.sleep((args.step_ms + (args.slow_ms if faulty and "slow" in faults else 0)) / 1000)
        x = torch.randn(32, 64, generator=data).to(device)
        with torch.autocast(args.device, dtype=torch.float16, enabled=args.amp):
            loss = model(x).float().pow(2).mean()
        if first and "nan" in faults:
            with torch.no_grad():
                model.module[0].weight[0, 0] = float("nan")
        if first and "inf" in faults:
            model.module[2].weight.register_hook(lambda grad: grad * float("inf"))
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        report = loss.detach().reshape(1)
        if "freeze" in faults and step == args.step and rank != args.rank:
            time.sleep(1)
        if first and "desync" in faults:
            dist.all_gather([torch.empty_like(report) for _ in range(dist.get_world_size())], report)
        elif first and faults & {"kill", "freeze"}:
            work = dist.all_reduce(report, async_op=True)
            os.kill(os.getpid(), signal.SIGKILL if "kill" in faults else signal.SIGSTOP)
            work.wait()
        else:
            dist.all_reduce(report)
        if args.metrics and step % 10 == 0:
            for work in [dist.all_reduce(torch.zeros(1, device=device), async_op=True) for _ in range(args.metrics)]:
                work.wait()
    dist.destroy_process_group()


def mark_fault_time() -> None:
    """The fault's wall time into ``FAULT_TIME_FILE``: what ``bench/detection.py`` measures from."""
    path = os.environ.get("FAULT_TIME_FILE")
    if path:
        with open(path, "w") as f:
            f.write(repr(time.time()))


if __name__ == "__main__":
    main()
