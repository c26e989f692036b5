"""test_collectives: ``exit_right_after_a_collective.py PORT DONE`` ends while a post-hook still runs on
gloo's thread; the post-hook creates the file DONE when it finishes."""

import os, sys, time
import torch, torch.distributed as dist
import commlens.hooks as ch

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
ch.instrument()

def slow_post_hook(args):  # runs on gloo's thread while the main thread goes on to exit
    time.sleep(0.3)
    open(sys.argv[2], "w").close()

ch.register_post_hook(slow_post_hook)
dist.all_reduce(torch.ones(4), async_op=True).get_future().wait()  # as DDP waits: wakes before the callbacks run
