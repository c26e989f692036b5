"""test_signals: a rank that trains while SIGTERMs arrive, and counts them; stops when its stdin ends."""

import signal, sys, threading, torch, torch.distributed as dist
import commlens.agent

handled = 0
def count(signum, frame):
    global handled
    handled += 1
signal.signal(signal.SIGTERM, count)
dist.init_process_group("gloo")
agent = commlens.agent.start()
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
t, steps = torch.ones(16), 0
while not stop.is_set():
    for _ in range(10):
        dist.all_reduce(t)
    agent.sidecar.drain()  # from the main thread too: a signal may come while it holds the sidecar's locks
    steps += 1
    print(steps, flush=True)
print("handled", handled, "snapshots", agent.sidecar.stats.snapshots["signal"], flush=True)
commlens.agent.stop()
