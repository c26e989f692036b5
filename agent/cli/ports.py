"""Free ports for metrics endpoints and stores, and the check that the ranks' metrics ports are free
before a job starts (``commlens demo``, ``commlens run``). Imports no torch.

Example::

    base = free_ports(4)                            # base .. base + 3 free on loopback now
    refuse_taken("0.0.0.0", 9464, 4, "local rank", "choose another")  # ConfigError: the first taken
"""

from __future__ import annotations

import random
import socket

from ..config import ConfigError


def free_port() -> int:
    """A port free on loopback now, outside the kernel's ephemeral range (see ``free_ports``)."""
    return free_ports(1)


_handed_out: set[int] = set()  # ports free_ports gave this process: free until bound, so not given twice


def free_ports(count: int, within: range | None = None) -> int:
    """A base port such that base .. base + count - 1 are all free on loopback now, none of them given
    out before by this process (chosen, perhaps not bound yet); drawn from ``within`` where given.

    They are drawn from below the kernel's ephemeral range, so that no outgoing connection (gloo's
    between ranks, the store's) can take one of them before the rank that is to serve on it binds it.
    """
    low = ephemeral_low()
    within = within or range(10000, low)
    if within.start < 10000 or within.stop > low or len(within) <= count:
        raise RuntimeError(f"no room for {count} ports in {within.start}..{within.stop - 1}, which must lie "
                           f"between 10000 and the ephemeral port range (starts at {low})")
    while True:
        ports = range(base := random.randrange(within.start, within.stop - count), base + count)
        if _handed_out.isdisjoint(ports) and all(map(is_free, ports)):
            _handed_out.update(ports)
            return base


def reserve(ports: range) -> None:
    """Keep ``free_port`` and ``free_ports`` from choosing ``ports`` (ones a job will serve on)."""
    _handed_out.update(ports)


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def is_free(port: int, addr: str = "127.0.0.1", reuse_address: bool = False) -> bool:
    """Whether ``port`` can be bound on ``addr`` now; ``reuse_address``: as a server that sets
    ``SO_REUSEADDR`` binds it (the metrics endpoints: prometheus-client's server, Python's
    ``HTTPServer``), to which a port whose last connections sit in TIME_WAIT is free, and one with a
    listener is not."""
    with socket.socket() as s:
        if reuse_address:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True


def refuse_taken(addr: str, base: int, count: int, whose: str | None, remedy: str) -> None:
    """Raise ``ConfigError`` when one of the metrics ports ``base .. base + count - 1`` (``whose`` 0, 1,
    … serve on them; None: one port) is taken on ``addr`` (none when base is 0): said before the job
    starts, not in a rank that would then train unobserved. ``remedy``: what the user can do. Taken as
    the metrics server would find it: a job run again at once on the same ports is not refused for its
    last job's scrapes, whose connections sit in TIME_WAIT for a minute."""
    taken = [base + i for i in range(count) if base and not is_free(base + i, addr, reuse_address=True)]
    if taken:
        which = f"port {taken[0]}" + (f" ({whose} {taken[0] - base})" if whose else "")
        raise ConfigError(f"COMMLENS_METRICS_PORT={base} is not accepted: {which} is in use on {addr}; {remedy}")
