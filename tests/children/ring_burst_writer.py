"""test_ring: ``ring_burst_writer.py PATH COUNT`` writes COUNT records as fast as it can into a
1,024-slot ring, on a line from its stdin."""

import sys

from commlens.ring.layout import START
from commlens.ring.memory import Ring
ring = Ring(slots=1024, path=sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
write = ring.write
for i in range(int(sys.argv[2])):
    write(START, i & 0xFF, 0, i & 0xFFFF, i, 3 * i, 7 * i, i & 0xFFFFFFFF, -1, (5 * i) & 0xFFFFFFFF)
print("done", flush=True)
sys.stdin.read()
