"""test_snapshots_sampling: ``snapshot_job.py ENDING PORT`` trains, then ends by SIGTERM (waiting for it)
or by an exception (ENDING "exception")."""

import os, sys, torch, torch.distributed as dist
import commlens.agent
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{sys.argv[2]}")
agent = commlens.agent.start()
for _ in range(3):
    dist.all_reduce(torch.ones(4))
print("trained", flush=True)
if sys.argv[1] == "exception":
    raise RuntimeError("the training loop broke")
sys.stdin.read()  # wait for SIGTERM, as a pod does
