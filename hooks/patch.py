"""In-place replacement of a library function, undone exactly: ``Patch(public, make)``.

The public function object is kept, so names bound to it before the patch are covered too:

* a function wrapped by c10d's exception-logging decorator: the function in the decorator's closure
  is swapped for ``make(original)``;
* a plain function: its code is forwarded to ``make(original)``, a copy of the original.

Example::

    patch = Patch(c10d.all_reduce, lambda original: recorded(original))
    ...
    patch.undo()
"""

from __future__ import annotations

import types
from typing import Callable


def _trampoline(*args, _commlens_target=None, **kwargs):
    return _commlens_target(*args, **kwargs)


class Patch:
    """One in-place replacement, undone by ``undo()``."""

    def __init__(self, public: Callable, make: Callable[[Callable], Callable]):
        code = public.__code__
        if "func" in code.co_freevars:  # c10d's logging decorator: swap the function it wraps
            self._cell = public.__closure__[code.co_freevars.index("func")]
            self._saved = self._cell.cell_contents
            self._cell.cell_contents = make(self._saved)
        else:  # a plain function: keep the object, forward its code to the wrapper
            self._cell, self._function = None, public
            self._saved = (code, public.__defaults__, public.__kwdefaults__)
            original = types.FunctionType(code, public.__globals__, public.__name__, public.__defaults__,
                                          public.__closure__)
            original.__kwdefaults__ = public.__kwdefaults__
            public.__code__, public.__defaults__ = _trampoline.__code__, None
            public.__kwdefaults__ = {"_commlens_target": make(original)}

    def undo(self) -> None:
        if self._cell is not None:
            self._cell.cell_contents = self._saved
        else:
            f = self._function
            f.__code__, f.__defaults__, f.__kwdefaults__ = self._saved
