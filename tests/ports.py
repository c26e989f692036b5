"""Free loopback ports for the tests, each pytest-xdist worker drawing from its own slice of the range.

``commlens.agent.cli.ports.free_ports`` keeps one process from handing out a port twice; tests running side
by side in several workers would still draw from one range, and a port chosen by one worker but not
yet bound could be chosen again by another. Each worker (``PYTEST_XDIST_WORKER`` gwN of
``PYTEST_XDIST_WORKER_COUNT``, inherited by the processes a test starts) draws from slice N alone.

Example::

    base = free_ports(3)   # base, base + 1, base + 2 are free now and no other worker's
"""

from __future__ import annotations

import os

from commlens.agent.cli import ports


def _slice() -> range:
    low = ports.ephemeral_low()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    size = (low - 10000) // workers
    return range(10000 + worker * size, 10000 + (worker + 1) * size)


def free_ports(count: int) -> int:
    """A base port such that base .. base + count - 1 are free on loopback now, in this worker's slice
    and not handed out before by this process."""
    return ports.free_ports(count, within=_slice())


def free_port() -> int:
    return free_ports(1)
