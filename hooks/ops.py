"""The collectives commlens records, and the hook arguments it passes for each.

``OpName`` values are the public ``torch.distributed`` function names; ``code`` is the byte stored
in ring records. ``fr_name`` is the name PyTorch's flight recorder and its analyzer use.
"""

from __future__ import annotations

import enum
from typing import Any


class OpName(enum.Enum):
    all_reduce = "all_reduce"
    broadcast = "broadcast"
    reduce = "reduce"
    all_gather = "all_gather"
    all_gather_into_tensor = "all_gather_into_tensor"
    reduce_scatter = "reduce_scatter"
    reduce_scatter_tensor = "reduce_scatter_tensor"
    all_to_all = "all_to_all"
    all_to_all_single = "all_to_all_single"
    gather = "gather"
    scatter = "scatter"
    barrier = "barrier"
    send = "send"
    recv = "recv"

    @property
    def is_p2p(self) -> bool:
        return self in (OpName.send, OpName.recv)

    @property
    def fr_name(self) -> str:
        return _FR_NAMES.get(self, self.value)


_FR_NAMES = {
    OpName.all_gather_into_tensor: "_all_gather_base",
    OpName.reduce_scatter_tensor: "_reduce_scatter_base",
    OpName.all_to_all_single: "all_to_all",
}
OPS = tuple(OpName)
CODE = {op: code for code, op in enumerate(OPS)}


class PreHookArgs:
    """What a pre-hook receives, before the collective is issued.

    ``tensors`` are the inputs and ``output_tensors`` the outputs (the same tensors for in-place
    ops); ``root`` and ``peer`` are ranks within ``pg_name``'s group, or None; ``rank`` is this
    process's global rank and ``group_rank`` its rank within the group.
    """

    __slots__ = ("name", "op_id", "pg", "pg_name", "seq", "tensors", "output_tensors", "async_op",
                 "root", "peer", "rank", "group_rank")

    def __init__(self, name: OpName, op_id: int, pg: Any, pg_name: str, seq: int, tensors: tuple,
                 output_tensors: tuple, async_op: bool, root: int | None, peer: int | None, rank: int,
                 group_rank: int):
        self.name, self.op_id, self.pg, self.pg_name, self.seq = name, op_id, pg, pg_name, seq
        self.tensors, self.output_tensors, self.async_op = tensors, output_tensors, async_op
        self.root, self.peer, self.rank, self.group_rank = root, peer, rank, group_rank

    def __repr__(self) -> str:
        return f"PreHookArgs({self.name.value}, op_id={self.op_id}, pg={self.pg_name!r}, seq={self.seq})"


class PostHookArgs:
    """What a post-hook receives, once the collective has completed (or failed).

    ``status`` is "ok", "error" or "timeout" ("not_issued": a DDP bucket whose communication hook
    issued no collective, such as ``noop_hook``; it has no sequence number of its own); times are
    ``time.monotonic_ns()`` values.
    """

    __slots__ = ("pre", "work", "status", "error", "start_ns", "end_ns")

    def __init__(self, pre: PreHookArgs, work: Any, status: str, error: BaseException | None,
                 start_ns: int, end_ns: int):
        self.pre, self.work, self.status, self.error = pre, work, status, error
        self.start_ns, self.end_ns = start_ns, end_ns

    name = property(lambda self: self.pre.name)
    op_id = property(lambda self: self.pre.op_id)
    output_tensors = property(lambda self: self.pre.output_tensors)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    def __repr__(self) -> str:
        return f"PostHookArgs({self.name.value}, op_id={self.op_id}, status={self.status})"


class AbortHookArgs:
    """What an abort hook receives when a collective fails or times out, before the error reaches
    the caller. (torchcomms' abort hooks take no argument; commlens says which collective failed.)
    ``pre`` is None when a process group itself is being aborted (PyTorch's own abort hook, torch
    >= 2.14): no collective is named then, and ``name`` and ``op_id`` are None."""

    __slots__ = ("pre", "error", "status")

    def __init__(self, pre: PreHookArgs | None, error: BaseException, status: str):
        self.pre, self.error, self.status = pre, error, status

    name = property(lambda self: self.pre.name if self.pre is not None else None)
    op_id = property(lambda self: self.pre.op_id if self.pre is not None else None)

    def __repr__(self) -> str:
        what = f"{self.name.value}, op_id={self.op_id}" if self.pre is not None else "process group"
        return f"AbortHookArgs({what}, status={self.status}, error={self.error!r})"
