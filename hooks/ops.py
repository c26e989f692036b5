"""The arguments commlens passes to each hook: before a collective is issued, once it completed or
failed, and when it failed or timed out (the collectives' names: ``OpName``).
"""

from __future__ import annotations

from typing import Any

from commlens.ring.ops import OpName


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
