"""In-place replacement of a library function, undone exactly: ``Patch(public, make)``. The public
function object is kept (inside c10d's logging decorator, or its code forwarded), so names bound
before the patch are covered too; ``Patches`` applies several as one, or none and a ``PatchError``.
See docs/hooks.md.

Example::

    patch = Patch(c10d.all_reduce, lambda original: recorded(original))
    ...
    patch.undo()
"""

from __future__ import annotations

import types
from typing import Callable


class PatchError(RuntimeError):
    """A function could not be patched; nothing was left patched."""


def _trampoline(*args, _commlens_target=None, **kwargs):
    return _commlens_target(*args, **kwargs)


_trampolines: dict[tuple[str, ...], types.CodeType] = {(): _trampoline.__code__}


def _trampoline_code(freevars: tuple[str, ...]) -> types.CodeType:
    """``_trampoline``'s code with exactly ``freevars`` as its free variables, in that order (Python
    ties a function's code to its closure: a closure's forwarding code needs the same free variables)."""
    code = _trampolines.get(freevars)
    if code is None:
        source = (f"def _outer():\n    {' = '.join(freevars)} = None\n"
                  f"    def _trampoline(*args, _commlens_target=None, **kwargs):\n"
                  f"        ({', '.join(freevars)},)\n        return _commlens_target(*args, **kwargs)\n"
                  f"    return _trampoline\n")
        scope: dict = {}
        exec(compile(source, "<commlens trampoline>", "exec"), scope)
        code = scope["_outer"]().__code__
        if code.co_freevars != freevars:
            raise PatchError(f"cannot forward a function whose free variables are {freevars}")
        _trampolines[freevars] = code
    return code


class Patch:
    """One in-place replacement, undone by ``undo()``."""

    def __init__(self, public: Callable, make: Callable[[Callable], Callable]):
        code = getattr(public, "__code__", None)
        if not isinstance(code, types.CodeType):
            raise PatchError(f"{public!r} is not a Python function, so it cannot be patched in place")
        if "func" in code.co_freevars:  # c10d's logging decorator: swap the function it wraps
            self._cell = public.__closure__[code.co_freevars.index("func")]
            self._saved = self._cell.cell_contents
            self._cell.cell_contents = make(self._saved)
        else:  # forward the function's code to the wrapper; the object stays
            self._cell, self._function = None, public
            self._saved = (code, public.__defaults__, public.__kwdefaults__)
            trampoline = _trampoline_code(code.co_freevars)
            original = types.FunctionType(code, public.__globals__, public.__name__, public.__defaults__,
                                          public.__closure__)
            original.__kwdefaults__ = public.__kwdefaults__
            target = make(original)
            public.__code__, public.__defaults__ = trampoline, None
            public.__kwdefaults__ = {"_commlens_target": target}

    def undo(self) -> None:
        if self._cell is not None:
            self._cell.cell_contents = self._saved
        else:
            f = self._function
            f.__code__, f.__defaults__, f.__kwdefaults__ = self._saved


class Replace:
    """``owner.name = make(original)``, undone by ``undo()``: for methods of extension types
    (``Work.wait``), whose instances look the method up on the type at each call."""

    def __init__(self, owner: type, name: str, make: Callable[[Callable], Callable]):
        self._owner, self._name, self._saved = owner, name, owner.__dict__[name]
        setattr(owner, name, make(getattr(owner, name)))

    def undo(self) -> None:
        setattr(self._owner, self._name, self._saved)


class Patches:
    """Patches applied together: ``add`` each, and on any failure every one applied is undone."""

    def __init__(self) -> None:
        self._applied: list[Patch | Replace] = []

    def add(self, public: Callable | tuple[type, str], make: Callable[[Callable], Callable], where: str) -> None:
        """Patch ``public`` in place, or replace a type's method given as ``(type, name)``."""
        try:
            self._applied.append(Replace(*public, make) if isinstance(public, tuple) else Patch(public, make))
        except Exception as error:
            self.undo()
            raise PatchError(f"commlens could not instrument {where}: {error}; nothing was instrumented") from error

    def undo(self) -> None:
        while self._applied:
            self._applied.pop().undo()

    def __bool__(self) -> bool:
        return bool(self._applied)
