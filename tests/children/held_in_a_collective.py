"""Two gloo ranks (under ``torchrun``): after one all_reduce, rank 1 holds back from the second until the
file ``argv[1]`` exists, and rank 0 waits for it there."""

import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
tensor = torch.ones(1)
dist.all_reduce(tensor)
if dist.get_rank() == 1:
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
dist.all_reduce(tensor)
dist.destroy_process_group()
