"""commlens.ring — the ring both sides share: the record's layout and codes (``layout``, ``ops``,
``codec``: the contract), the ring's memory (``memory``: a private or shared-memory file, written
through its C producer), and its read side (``reader``: the cursor and the fold; ``dumps``: PyTorch's
flight-recorder dumps of its records). The writers are commlens.hooks'; the readers the agent's.
Imports no torch, and nothing of commlens.hooks (``tests/test_layout.py``).

Example::

    from commlens.ring import START, Ring, RingReader
    reader = RingReader(Ring.attach("/dev/shm/commlens/local-rank-0.ring"))
    starts = [r for r in reader.read() if r.kind == START]
"""

from .layout import END, NAN, START, Record
from .memory import Ring
from .reader import RingReader

__all__ = ["END", "NAN", "START", "Record", "Ring", "RingReader"]
