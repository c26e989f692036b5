"""test_launch: an unmodified torchrun script, ``launch_train.py FOLDER``: it trains, says it is ready, and
ends once the test creates FOLDER/done."""

import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
for _ in range(5):
    dist.all_reduce(torch.ones(8))
dist.barrier()
folder = sys.argv[1]
open(os.path.join(folder, f"ready-{dist.get_rank()}"), "w").close()
while not os.path.exists(os.path.join(folder, "done")):  # the test scrapes our metrics meanwhile
    time.sleep(0.05)
dist.destroy_process_group()
