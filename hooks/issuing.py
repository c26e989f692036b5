"""The issuing protocol every source of collectives follows: start → issuing → call → failed or settle.

``record()`` is the whole of it; a source that sees a collective through two callbacks calls its
halves, ``start()`` then ``settle()``. ``issuing()`` is true on a thread while a wrapper issues a
collective (``_issuing.c``), so that PyTorch's own process-group hooks step aside. docs/architecture.md.

Example::

    result = issuing.record(OpName.all_reduce, group, (t,), (t,), False, None, None,
                            torch_all_reduce, (t,), {})
"""

from __future__ import annotations

from typing import Any, Callable

from commlens.ring.ops import OpName

from . import _issuing, process_ring
from .record import Group
from .recorder import HookRaised, InFlight, all_tensors, begin

issuing: Callable[[], bool] = _issuing.issuing
"""True on a thread while one of commlens' wrappers issues a collective."""
set_issuing: Callable[[bool], bool] = _issuing.set_issuing
"""``set_issuing(on)`` sets ``issuing()`` and returns what it was."""


def start(op: OpName, group: Group, tensors: tuple, output_tensors: tuple, async_op: bool,
          root: int | None, peer: int | None, bucket: Any = None, inputs_finite: bool = False) -> InFlight | None:
    """``recorder.begin()`` behind the error boundary: a propagating pre-hook's error is raised to
    the caller as it is; a failure of commlens itself is counted and gives None (the op then goes
    on unrecorded)."""
    try:
        return begin(op, group, tensors, output_tensors, async_op, root, peer, bucket, inputs_finite)
    except HookRaised as raised:
        raised.reraise()
    except Exception as error:
        if all_tensors(tensors, output_tensors):  # else the caller's mistake, which torch reports itself
            process_ring.internal_error("begin", error)
        return None


def issue(flight: InFlight, call: Callable, /, *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` issuing ``flight``'s collective, with PyTorch's own hooks stepping aside; if it
    raises, the op failed (END, abort hooks) and the error propagates."""
    was = set_issuing(True)
    try:
        return call(*args, **kwargs)
    except BaseException as error:
        flight.failed(error)
        raise
    finally:
        set_issuing(was)


def stepping_aside(wrapper: Callable) -> Callable:
    """``wrapper`` with ``issuing()`` true while it runs (and as it was after): PyTorch's own process-group
    hooks step aside for whatever it issues, recorded or not (native.py)."""

    def collective(*args: Any, **kwargs: Any) -> Any:
        if set_issuing(True):  # inside another wrapper's collective (a sync send's isend, a DDP bucket's all_reduce)
            return wrapper(*args, **kwargs)
        try:
            return wrapper(*args, **kwargs)
        finally:
            set_issuing(False)

    return collective


def settle(step: Callable[..., None], *args: Any) -> None:
    """``step(*args)`` once the op is issued (``InFlight.issued`` or a source's own): as ``start()``
    does, a propagating post-hook's error reaches the caller, a failure of commlens is counted."""
    try:
        step(*args)
    except HookRaised as raised:
        raised.reraise()
    except Exception as error:
        process_ring.internal_error("issued", error)


def record(op: OpName, group: Group, tensors: tuple, output_tensors: tuple, async_op: bool, root: int | None,
           peer: int | None, call: Callable, args: tuple, kwargs: dict,
           after: Callable[[InFlight, Any], None] = InFlight.issued) -> Any:
    """``call(*args, **kwargs)`` recorded as ``op``: ``start``, ``issue``, then ``settle`` with
    ``after(flight, result)``; unrecorded when ``start`` could not record it."""
    flight = start(op, group, tensors, output_tensors, async_op, root, peer)
    if flight is None:
        return call(*args, **kwargs)
    result = issue(flight, call, *args, **kwargs)
    settle(after, flight, result)
    return result
