"""A verdict: the kind (``catalogue``), the ranks it names, where, and the evidence."""

from __future__ import annotations

import dataclasses

from .catalogue import KIND


@dataclasses.dataclass(frozen=True)
class Finding:
    kind: str
    """A ``Kind``'s name (``catalogue.KINDS``)."""
    ranks: tuple[int, ...]
    pg: str
    op: str
    seq: int | None
    evidence: str
    waits_in: tuple[str, ...] = ()
    """A deadlock link's: the groups its ranks wait in (where the chain goes on)."""
    node: str = ""
    """A node_unreachable's or node_slow's: the node (``ranks``: its ranks)."""

    def line(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {', '.join(map(str, self.ranks))}"
        if self.node:
            who = f"node {self.node} ({who})"
        if self.kind == "network_slow":
            who = "every rank waits"
        where = f"{self.op} (group {self.pg}" + (f", seq {self.seq})" if self.seq is not None else ")") \
            if self.op else "the job"
        return f"{KIND[self.kind].title} {who} in {where} — {self.evidence}"
