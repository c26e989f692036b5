"""Ranks that disagree about a collective: a desync (different ops at one sequence number) and a size
mismatch (different shapes or dtypes where every member must give the same)."""

from __future__ import annotations

import collections

from ..facts import RankFacts
from ..finding import Finding
from .waits import ranks_by_seq


SAME_INPUTS = ("all_reduce", "reduce", "broadcast")
"""Ops whose input tensors every rank gives alike, in dtype and size (others, all_gather say, may be uneven)."""


def desync(pg: str, seq: int, wrong: dict[int, str], others: list[int], op: str) -> Finding:
    theirs = ", ".join(sorted(set(wrong.values())))
    return Finding("desync", tuple(sorted(wrong)), pg, theirs, seq,
                   f"issued {theirs} at seq {seq} where ranks {others} issued {op}")


def mismatch(pg: str, members: list[RankFacts]) -> list[Finding]:
    """After the fact: the first sequence number at which ranks issued different ops."""
    by_seq = ranks_by_seq(pg, members, "arrivals")
    for seq in sorted(by_seq):
        ops = {rank: op for rank, (op, _) in by_seq[seq].items()}
        majority, count = collections.Counter(ops.values()).most_common(1)[0]
        wrong = {rank: op for rank, op in ops.items() if op != majority}
        if wrong and count > len(wrong):
            return [desync(pg, seq, wrong, sorted(r for r, op in ops.items() if op == majority), majority)]
    return []


def size_mismatch(pg: str, members: list[RankFacts]) -> list[Finding]:
    """After the fact, from the dumps: the first collective of the group whose inputs differ between
    ranks that issued the same op, in dtype (any op) or in size (``SAME_INPUTS``): the fewer gave the
    wrong ones. gloo aborts the processes in it ("Received data size doesn't match"), NCCL hangs."""
    by_seq = ranks_by_seq(pg, members, "inputs")
    for seq in sorted(by_seq):
        ops = {op for op, _ in by_seq[seq].values()}
        if len(ops) > 1:  # a desync, told by the ops
            continue
        op = ops.pop()
        if op in SAME_INPUTS:
            told = {rank: tensors for rank, (_, tensors) in by_seq[seq].items()}
        else:  # a scatter's root alone gives inputs, an all_gather's may be uneven: the dtypes given
            told = {rank: _dtypes(tensors) for rank, (_, tensors) in by_seq[seq].items() if tensors}
        if not told:
            continue
        majority, count = collections.Counter(told.values()).most_common(1)[0]
        wrong = sorted(rank for rank, given in told.items() if given != majority)
        if wrong and count > len(wrong):
            theirs = sorted(rank for rank in told if rank not in wrong)
            return [Finding("size_mismatch", tuple(wrong), pg, op, seq,
                            f"its input was {' / '.join(sorted(set(by_seq[seq][r][1] for r in wrong)))} where ranks "
                            f"{theirs} gave {by_seq[seq][theirs[0]][1]}")]
    return []


def _dtypes(tensors: str) -> frozenset[str]:
    """The dtypes of a dump entry's tensors as ``readers`` writes them (``"Float[8], Float[2, 4]"``)."""
    return frozenset(tensor.partition("[")[0] for tensor in tensors.split("], "))
