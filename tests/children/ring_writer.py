"""test_ring: writes 100 records into a 64-slot ring file, then stays alive until its stdin ends."""

import sys
from commlens.hooks import Ring, START, END
ring = Ring(slots=64, path=sys.argv[1])
sid = ring.intern("group 0")
for i in range(100):
    ring.write(START if i % 2 == 0 else END, 1, 0, sid, i, i, 4 * i, 0, -1, 0, 0, i)
print("written", flush=True)
sys.stdin.read()  # stay alive while the other process reads
