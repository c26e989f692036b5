"""test_signals: a rank whose forked child (a data-loader worker, say) gets SIGTERM."""

import os, signal, torch, torch.distributed as dist
import commlens.agent

dist.init_process_group("gloo")
agent = commlens.agent.start()
dist.all_reduce(torch.ones(4))
ready, told = os.pipe()
child = os.fork()
if child == 0:  # a DataLoader worker, say: the parent's socket is shared, the thread is not
    os.write(told, b"!")
    signal.pause()
    os._exit(0)
os.read(ready, 1)
os.kill(child, signal.SIGTERM)
_, status = os.waitpid(child, 0)
commlens.agent.stop()  # the thread reads what is in its socket before it ends
print(os.WIFSIGNALED(status) and os.WTERMSIG(status), agent.sidecar.stats.snapshots["signal"], flush=True)
