"""The strings records refer to by id (``pg``, ``sig``): JSON, encoded by the writers and decoded here by
every reader. Imports nothing.

Example::

    text = encode_group("0", "default_pg", [0, 1, 2, 3], 2, "gloo")
    decode_group(text).own_rank                            # 2
    decode_signature(encode_signature([([4], "Float")], [([4], "Float")])).dtype   # "Float"
"""

from __future__ import annotations

import json
from typing import NamedTuple


class GroupDescription(NamedTuple):
    """A group as its records describe it: ``name``, ``desc``, global ``ranks``, the writer's ``rank``."""

    name: str
    desc: str
    ranks: list[int]
    rank: int
    backend: str

    @property
    def own_rank(self) -> int:
        """The writer's rank in the group (-1: not in it)."""
        return self.ranks.index(self.rank) if self.rank in self.ranks else -1


def encode_group(name: str, desc: str, ranks: list[int], rank: int, backend: str) -> str:
    return json.dumps({"name": name, "desc": desc, "ranks": ranks, "rank": rank, "backend": backend})


def decode_group(text: str) -> GroupDescription | None:
    """The group ``encode_group`` described; None for text that is not one."""
    try:
        found = json.loads(text)
        return GroupDescription(str(found["name"]), str(found.get("desc", "")), [int(r) for r in found["ranks"]],
                                int(found.get("rank", -1)), str(found.get("backend", "")))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class Signature(NamedTuple):
    """An op's tensors as its ``sig`` string gives them: shapes and c10 dtype names ("Float")."""

    in_sizes: list[list[int]]
    in_dtypes: list[str]
    out_sizes: list[list[int]]
    out_dtypes: list[str]

    @property
    def dtype(self) -> str:
        """The op's dtype: its first input's, else its first output's ("" when it has no tensors)."""
        return (self.in_dtypes or self.out_dtypes or [""])[0]


NO_SIGNATURE = Signature([], [], [], [])


def encode_signature(inputs: list[tuple[list[int], str]], outputs: list[tuple[list[int], str]]) -> str:
    """The ``sig`` string of an op whose inputs and outputs have these (shape, dtype name) pairs."""
    return json.dumps([[s for s, _ in inputs], [d for _, d in inputs], [s for s, _ in outputs], [d for _, d in outputs]])


def decode_signature(text: str) -> Signature:
    """The signature ``encode_signature`` wrote; ``NO_SIGNATURE`` for text that is not one."""
    try:
        in_sizes, in_dtypes, out_sizes, out_dtypes = json.loads(text)
    except (ValueError, TypeError):
        return NO_SIGNATURE
    return Signature(in_sizes, in_dtypes, out_sizes, out_dtypes)
