"""The collectives commlens records: their names (``OpName``, the public ``torch.distributed`` function
names) and the byte ring records store for each (``CODE``; ``OPS`` by code). ``fr_name`` is the name
PyTorch's flight recorder and its analyzer use. Imports nothing.
"""

from __future__ import annotations

import enum


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
