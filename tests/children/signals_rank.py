"""A rank of test_signals' jobs: ``signals_rank.py MODE [FILE]`` (rank 1 joins the second all_reduce
only when the test writes a line to its stdin)."""

import os, signal, sys, time, torch, torch.distributed as dist
import commlens.agent

rank, mode = int(os.environ["RANK"]), sys.argv[1]
dist.init_process_group("gloo")
if rank == 1:  # joins the first all_reduce; the second only when the test writes a line to its stdin
    dist.all_reduce(torch.ones(4))
    if sys.stdin.readline():
        dist.all_reduce(torch.ones(4))
    os._exit(0)
if mode == "user":
    def on_sigterm(signum, frame):
        with open(sys.argv[2], "w") as f:
            f.write("handled")
        dist.destroy_process_group()  # torch 2.13's gloo may abort a process that exits with a live group
        sys.exit(3)
    signal.signal(signal.SIGTERM, on_sigterm)
commlens.agent.start()
dist.all_reduce(torch.ones(4))
agent = commlens.agent.current()
if mode == "in-snapshot":  # as if interrupted inside agent.snapshot() ...
    agent._snapshot_lock.acquire()
if mode == "chained":  # a handler of the user's, installed after commlens', that passes SIGTERM on to it
    theirs = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: theirs(signum, frame))
if mode in ("in-snapshot", "in-drain"):  # ... or inside sidecar.drain(), on this thread
    agent.sidecar._draining.acquire()
    agent.sidecar.stats.lock.acquire()
print("ready", flush=True)
while mode in ("python", "in-snapshot", "in-drain"):
    pass
while mode == "busy":  # in and out of the lock a scrape copies the counters under, as a drain on this thread is
    with agent.sidecar.stats.lock:
        held = time.monotonic() + 0.01
        while time.monotonic() < held:
            pass
dist.all_reduce(torch.ones(4))  # rank 1 is not there
print("returned", flush=True)
