"""Which tensors the C scan (``_nonfinite.c``) proves finite, and the scan itself.

The NaN check's common case on the CPU, shared by its hook (``nan_check``) and by the hot path
(``recorder.run_unhooked``), which leaves the hook out when the scan proves a collective's inputs
finite. ``scan_of`` depends only on a tensor's dtype and size, so the hot path keeps it with the
tensor's signature and reads the tensor itself only for what changes between calls.

Example::

    scan = scan_of(t.dtype, t.numel())   # (floats, kind), or None: not scanned here
    scanned(t, scan)                     # True / False, or None: t cannot be read here
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import _nonfinite
from ._nonfinite import KIND_BFLOAT16, KIND_FLOAT16, KIND_FLOAT32, KIND_FLOAT64

SCAN_UP_TO = 1 << 18
"""Floats scanned in C, holding the GIL (~9 µs at most here: 1 MiB of float32); a larger tensor is summed
by torch, on as many threads as torch uses, at the same speed on one thread (bench/nan_check.py)."""
_KINDS = {torch.float32: (KIND_FLOAT32, 1), torch.float64: (KIND_FLOAT64, 1), torch.float16: (KIND_FLOAT16, 1),
          torch.bfloat16: (KIND_BFLOAT16, 1), torch.complex64: (KIND_FLOAT32, 2),
          torch.complex128: (KIND_FLOAT64, 2)}
"""dtype -> (the kind of float ``scanned`` scans, floats per element)."""


def scan_of(dtype: torch.dtype, numel: int) -> tuple[int, int] | None:
    """``(floats, kind)`` that ``scanned`` reads of a tensor of ``dtype`` and ``numel`` elements:
    ``(0, 0)`` when it holds no floats (nothing to prove); None when its floats are not scanned here
    (a dtype the scan does not know, or more than ``SCAN_UP_TO``)."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return 0, 0
    kind = _KINDS.get(dtype)
    if kind is None or numel * kind[1] > SCAN_UP_TO:
        return None
    return numel * kind[1], kind[0]


scanned: Callable[[Any, tuple[int, int]], bool | None] = _nonfinite.scanned
"""``scanned(t, scan)``: whether ``t``, of the dtype and size ``scan`` was made for, holds only finite
values, in one pass in C over its memory. None when that memory cannot be read here: not a contiguous
CPU tensor with data (a CUDA, sparse, strided, fake or wrapper tensor)."""


def counted(t: Any) -> tuple[int, int] | None:
    """``(NaNs, Infs)``: the elements of ``t`` that hold NaN and Inf, counted in C in one pass where
    ``scanned`` could read it (of any size: past ``SCAN_UP_TO`` floats without holding the GIL) and
    its dtype is real; None otherwise (torch counts them then, 20x slower).

    >>> counted(torch.tensor([1.0, float("nan"), float("inf"), -float("inf")]))
    (1, 2)
    """
    kind = _KINDS.get(t.dtype)
    if kind is None or kind[1] != 1:
        return None
    return _nonfinite.counted(t, (t.numel(), kind[0]))


def inputs_finite(tensors: tuple) -> bool:
    """Whether the scan proves every one of ``tensors`` finite. False when any cannot be scanned
    here: the NaN check's hook then decides."""
    for t in tensors:
        scan = scan_of(t.dtype, t.numel())
        if scan is None or scanned(t, scan) is not True:
            return False
    return True
