"""test_ring: a ring's writer that forks a child (a data-loader worker), then kills itself."""

import os, signal, sys
from commlens.hooks import Ring
ring = Ring(slots=64, path=sys.argv[1])
child_ready, ready = os.pipe()
if os.fork() == 0:  # a data-loader worker: it outlives the writer
    os.write(ready, b"!")  # its at-fork handlers have run (they closed its copy of the ring's flock)
    sys.stdin.read()
    os._exit(0)
os.read(child_ready, 1)  # a writer killed before then would leave the flock with a child not yet run
print("forked", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
