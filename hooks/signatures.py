"""An op's ``sig`` and payload bytes, from its tensors: interned once per shape, looked up after.

Example::

    sig, nbytes = signatures.signature((t,), (t,))   # the string id of '[[[4]], ["Float"], [[4]], ["Float"]]', 16
"""

from __future__ import annotations

from typing import Any

from commlens.ring.codec import encode_signature

from . import finite, process_ring

_DTYPE_NAMES: dict[Any, str] = {}
_signatures: dict[tuple, tuple[int, int]] = {}
"""(shapes and dtypes of the inputs, of the outputs) -> signature and payload bytes."""
in_place: dict[tuple, tuple[int, int, tuple[int, int] | None]] = {}
"""(shape, dtype) of an op's one tensor, input and output at once -> its signature, payload bytes and
``finite.scan_of``: one entry per shape for the signature and the NaN check's scan."""


def dtype_name(dtype: Any) -> str:
    """c10's name for a dtype ("Float", "BFloat16"), as PyTorch's flight recorder writes it."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        import torch

        name = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
                torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
                torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool", torch.complex64: "ComplexFloat",
                torch.complex128: "ComplexDouble"}.get(dtype, str(dtype).removeprefix("torch."))
        _DTYPE_NAMES[dtype] = name
    return name


def _meta(tensors: tuple) -> tuple:
    return tuple([(t.shape, t.dtype) for t in tensors])


def signature(tensors: tuple, output_tensors: tuple) -> tuple[int, int]:
    """(string id of the shapes and dtypes, payload bytes) for an op's inputs and outputs.

    Payload bytes are the larger of the input and output totals: the nccl-tests "size" of the op.
    """
    if len(tensors) == 1 and output_tensors is tensors:  # the common in-place case, keyed cheaply
        t = tensors[0]
        key = (t.shape, t.dtype)
        return (in_place.get(key) or describe_in_place(t, key))[:2]
    key = (_meta(tensors), _meta(output_tensors))
    return _signatures.get(key) or _signatures.setdefault(key, _new_signature(tensors, output_tensors))


def _new_signature(tensors: tuple, outs: tuple) -> tuple[int, int]:
    in_bytes = sum(t.numel() * t.element_size() for t in tensors)
    out_bytes = sum(t.numel() * t.element_size() for t in outs)
    text = encode_signature([(list(t.shape), dtype_name(t.dtype)) for t in tensors],
                            [(list(t.shape), dtype_name(t.dtype)) for t in outs])
    return process_ring.ring().intern(text), max(in_bytes, out_bytes)


def describe_in_place(t: Any, key: tuple) -> tuple[int, int, tuple[int, int] | None]:
    """``in_place``'s entry for tensor ``t`` of ``key`` (its shape and dtype), made on first use."""
    tensors = (t,)
    return in_place.setdefault(key, (*_new_signature(tensors, tensors), finite.scan_of(t.dtype, t.numel())))
