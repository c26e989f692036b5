"""``NanCheckHook``: finds NaN and Inf in the tensors of collectives.

Example::

    check = NanCheckHook(mode="raise").register_with_comm()   # all torch.distributed groups
    dist.all_reduce(t)   # RuntimeError naming op, rank, group and tensor if t holds NaN or Inf
    check.unregister()
"""

from __future__ import annotations

import cmath
from typing import Any

import torch

from commlens.ring.layout import NAN_HAS_INF as FLAG_INF, NAN_HAS_NAN as FLAG_NAN, NAN_OUTPUT as FLAG_OUTPUT
from commlens.ring.ops import OpName

from . import cuda, finite
from .ops import PostHookArgs, PreHookArgs
from .registry import register_input_check, register_post_hook

MODES = ("report", "raise")


class NanCheckHook:
    """Checks inputs (and, with ``check_outputs``, outputs) of every collective for NaN and Inf.

    On a CUDA tensor, report mode never synchronises and raise mode does (docs/gpu.md).

    ``mode="report"``: each finding is a NAN record in the ring (tensor index in ``aux``, count of
    non-finite elements in ``nbytes``, ``FLAG_*`` bits in ``flags``) and the collective proceeds.
    ``mode="raise"``: the collective is not issued; a ``RuntimeError`` names op, rank, group,
    tensor index and what was found (an output of an async op completes on another thread, so its
    finding is reported instead). Tensors that are not floating point or complex are skipped; of a
    sparse tensor, the stored values are checked.

    ``every``: DDP's gradient buckets are checked on one step in ``every`` (``DdpBucket.step`` a
    multiple of it), other collectives always. On a GPU the check of a bucket is a pass over it that
    competes with the backward pass (docs/gpu.md); a NaN on an unchecked step is found on the next
    checked one, once it has spread to every rank: every rank is then reported, not its origin.
    """

    def __init__(self, mode: str = "report", check_outputs: bool = False, every: int = 1):
        if mode not in MODES:
            raise ValueError(f"NanCheckHook mode={mode!r} is not accepted: use one of {', '.join(MODES)}")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"NanCheckHook every={every!r} is not accepted: use an integer >= 1 (steps)")
        self.mode, self.check_outputs, self.every = mode, check_outputs, every
        self.events = 0
        self._handles: list[Any] = []

    def register_with_comm(self, comm: Any = None) -> NanCheckHook:
        """Check the collectives of ``comm``: a torchcomms communicator, or torch.distributed when None."""
        if comm is None:
            raising = self.mode == "raise"
            report = None if raising else (self._reported, self._found_on_device)
            self._handles.append(register_input_check(self._pre, propagate=raising, report=report))
            if self.check_outputs:
                self._handles.append(register_post_hook(self._post, propagate=raising))
        else:
            from .torchcomms import attach

            self._handles.append(attach(comm, pre=self._pre, post=self._post if self.check_outputs else None,
                                        propagate=self.mode == "raise"))
        return self

    def unregister(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _pre(self, args: PreHookArgs) -> None:
        bucket = getattr(args, "bucket", None)  # a DDP gradient bucket's (``ddp.DdpBucket``)
        if bucket is not None and bucket.step % self.every:
            return
        if args.name is OpName.broadcast and args.root is not None and args.root != args.group_rank:
            return  # on a rank other than the root, a broadcast's tensor is the buffer it receives into
        self._check(args, args.tensors, 0)

    def _post(self, args: PostHookArgs) -> None:
        if args.status == "ok":
            self._check(args.pre, args.output_tensors, FLAG_OUTPUT)

    def _check(self, call: PreHookArgs, tensors: tuple, which: int) -> None:
        for index, t in enumerate(tensors):
            t = _values(t)
            if not (t.is_floating_point() or t.is_complex()):
                continue
            if t.is_cuda and self.mode == "report":  # on the device, read when ready: no host sync
                cuda.tracker().check(t, call.nan_args(index, which), self._found_on_device)
                continue
            counts = None if t.is_cuda else finite.counted(t)  # one pass in C: found finite or counted
            if counts is None:
                if tensor_finite(t):  # on a CUDA tensor in raise mode, this waits for the device
                    continue
                counts = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            nans, infs = counts
            if not nans and not infs:  # every element is finite (a sum of finite values may overflow)
                continue
            if self.mode == "raise" and not (which and call.async_op):
                self.events += 1
                raise RuntimeError(
                    f"commlens NaN check: {call.name.value} (op_id {call.op_id}, seq {call.seq}) on rank "
                    f"{call.rank}, group {call.pg_name!r}: {'output' if which else 'input'} tensor {index} holds "
                    f"{nans} NaN and {infs} Inf of {t.numel()} elements")
            self._found(call, index, which | (FLAG_NAN if nans else 0) | (FLAG_INF if infs else 0), nans + infs)

    def _reported(self, t: torch.Tensor) -> tuple[int, int] | None:
        """The NAN record's (flags, count) for an input ``t`` of the C all_reduce's (one dense CPU
        tensor, found non-finite by its scan); None where it could not be counted."""
        counts = finite.counted(t)
        if counts is None:
            return None
        nans, infs = counts
        self.events += 1
        return (FLAG_NAN if nans else 0) | (FLAG_INF if infs else 0), nans + infs

    def _found_on_device(self, flags: int) -> None:
        """A CUDA tensor held NaN or Inf (``flags``); the GPU's poll wrote its NAN record."""
        self.events += 1

    def _found(self, call: PreHookArgs, index: int, flags: int, count: int) -> None:
        """A NAN record: tensor ``index`` of ``call`` held ``count`` non-finite elements (0: not counted)."""
        self.events += 1
        call.nan(index, flags, count)

    def __enter__(self) -> NanCheckHook:
        return self.register_with_comm()

    def __exit__(self, *exc: object) -> None:
        self.unregister()


_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.complex32: torch.complex64}


def tensor_finite(t: torch.Tensor) -> bool:
    """One pass over ``t``; True proves every element finite, False sends it to the exact
    per-element count. A tensor the C scan can read is scanned (``finite``: 0.5 µs for 4 KiB, where a
    ``torch.sum`` takes 1.1, most of it torch's dispatch); any other is summed on its device, where
    one NaN or Inf makes the sum non-finite."""
    scan = finite.scan_of(t.dtype, t.numel())
    found = None if scan is None else finite.scanned(t, scan)
    if found is not None:
        return found
    return cmath.isfinite(t.sum(dtype=_WIDE.get(t.dtype)).item())


_SPARSE_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse tensor (COO, CSR, CSC, BSR, BSC); a dense tensor itself."""
    if t.layout is torch.strided:
        return t
    if t.layout is torch.sparse_coo:
        return t._values()
    return t.values() if t.layout in _SPARSE_COMPRESSED else t
