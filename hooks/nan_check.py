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

from . import cuda, recorder
from ._nonfinite import KIND_BFLOAT16, KIND_FLOAT16, KIND_FLOAT32, KIND_FLOAT64, all_finite
from .ops import OpName, PostHookArgs, PreHookArgs
from .registry import register_input_check, register_post_hook
from .ring import NAN_HAS_INF as FLAG_INF, NAN_HAS_NAN as FLAG_NAN, NAN_OUTPUT as FLAG_OUTPUT

MODES = ("report", "raise")


class NanCheckHook:
    """Checks inputs (and, with ``check_outputs``, outputs) of every collective for NaN and Inf.

    On a CUDA tensor, report mode sums it on the device and reads the sum when it is ready, without
    synchronising (``hooks/cuda.py``): NaN and Inf are then told apart by the sum (NaN, or ±Inf) and
    the count is not known (0). Raise mode synchronises, since it must refuse the collective first.

    ``mode="report"``: each finding is a NAN record in the ring (tensor index in ``aux``, count of
    non-finite elements in ``nbytes``, ``FLAG_*`` bits in ``flags``) and the collective proceeds.
    ``mode="raise"``: the collective is not issued; a ``RuntimeError`` names op, rank, group,
    tensor index and what was found (an output of an async op completes on another thread, so its
    finding is reported instead). Tensors that are not floating point or complex are skipped; of a
    sparse tensor, the stored values are checked.
    """

    def __init__(self, mode: str = "report", check_outputs: bool = False):
        if mode not in MODES:
            raise ValueError(f"NanCheckHook mode={mode!r} is not accepted: use one of {', '.join(MODES)}")
        self.mode, self.check_outputs = mode, check_outputs
        self.events = 0
        self._handles: list[Any] = []

    def register_with_comm(self, comm: Any = None) -> NanCheckHook:
        """Check the collectives of ``comm``: a torchcomms communicator, or torch.distributed when None."""
        if comm is None:
            raising = self.mode == "raise"
            self._handles.append(register_input_check(self._pre, propagate=raising))
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
                cuda.tracker().check(t, lambda flags, index=index: self._found(call, index, which | flags, 0))
                continue
            if tensor_finite(t):  # on a CUDA tensor in raise mode, this waits for the device
                continue
            nans, infs = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            if not nans and not infs:  # the sum overflowed; every element is finite
                continue
            if self.mode == "raise" and not (which and call.async_op):
                self.events += 1
                side = "output" if which else "input"
                raise RuntimeError(
                    f"commlens NaN check: {call.name.value} (op_id {call.op_id}, seq {call.seq}) on rank "
                    f"{call.rank}, group {call.pg_name!r}: {side} tensor {index} holds {nans} NaN and {infs} "
                    f"Inf of {t.numel()} elements")
            self._found(call, index, which | (FLAG_NAN if nans else 0) | (FLAG_INF if infs else 0), nans + infs)

    def _found(self, call: PreHookArgs, index: int, flags: int, count: int) -> None:
        """A NAN record: tensor ``index`` of ``call`` held ``count`` non-finite elements (0: not counted)."""
        self.events += 1
        recorder.record_nan(call, index, flags, count)

    def __enter__(self) -> NanCheckHook:
        return self.register_with_comm()

    def __exit__(self, *exc: object) -> None:
        self.unregister()


_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.complex32: torch.complex64}
_SCANNED = {torch.float32: (KIND_FLOAT32, 1), torch.float64: (KIND_FLOAT64, 1), torch.float16: (KIND_FLOAT16, 1),
            torch.bfloat16: (KIND_BFLOAT16, 1), torch.complex64: (KIND_FLOAT32, 2), torch.complex128: (KIND_FLOAT64, 2)}
"""dtype -> (the kind of float ``all_finite`` scans, floats per element)."""


_SCAN_UP_TO = 1 << 18
"""Floats scanned in C, holding the GIL (~13 µs at most: 1 MiB of float32); a larger tensor is summed
by torch, on as many threads as torch uses, at the same speed on one thread (bench/nan_check.py)."""


def _scannable(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(address, floats, kind) for ``all_finite`` when ``t`` is a contiguous CPU tensor with data, of
    a ``_SCANNED`` dtype, of at most ``_SCAN_UP_TO`` floats; None otherwise (a fake or wrapper
    tensor, whose data cannot be read, included)."""
    scanned = _SCANNED.get(t.dtype)
    if scanned is None or not t.is_cpu or t.layout is not torch.strided:
        return None
    floats = t.numel() * scanned[1]
    if floats > _SCAN_UP_TO or not t.is_contiguous():
        return None
    try:
        address = t.data_ptr()
    except RuntimeError:
        return None
    return (address, floats, scanned[0]) if address or not floats else None


def tensor_finite(t: torch.Tensor) -> bool:
    """One pass over ``t``; True proves every element finite, False sends it to the exact
    per-element count. A ``_scannable`` tensor is scanned in C (``_nonfinite.c``: 0.7 µs for 4 KiB,
    where a ``torch.sum`` takes 1.5, most of it torch's dispatch); any other is summed on its
    device, where one NaN or Inf makes the sum non-finite."""
    scan = _scannable(t)
    if scan is not None:
        return all_finite(*scan)
    return cmath.isfinite(t.sum(dtype=_WIDE.get(t.dtype)).item())


def inputs_finite(tensors: tuple) -> bool:
    """Whether every input of a collective is proven finite by a scan on the CPU: the hot path's
    test before it skips the check's hook (``register_input_check``). False when any cannot be
    scanned (on a GPU, too large, strided, sparse, without readable data): the hook then runs and
    decides."""
    for t in tensors:
        scan = _scannable(t)
        if scan is None:
            if t.is_floating_point() or t.is_complex():
                return False
        elif not all_finite(*scan):
            return False
    return True


_SPARSE_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse tensor (COO, CSR, CSC, BSR, BSC); a dense tensor itself."""
    if t.layout is torch.strided:
        return t
    if t.layout is torch.sparse_coo:
        return t._values()
    return t.values() if t.layout in _SPARSE_COMPRESSED else t
