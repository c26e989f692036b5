"""A rank of test_signals' stopped job, both ranks under commlens: each prints "serving" after a
first all_reduce; at the test's first line, rank 0 issues a second all_reduce that rank 1 never
joins (it waits for a second line) and prints "issued"."""

import os, sys, torch, torch.distributed as dist
import commlens.agent

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
commlens.agent.start()
dist.all_reduce(torch.ones(4))
print("serving", flush=True)
sys.stdin.readline()
if rank == 0:
    work = dist.all_reduce(torch.ones(4), async_op=True)
    print("issued", flush=True)
    work.wait()
sys.stdin.readline()
