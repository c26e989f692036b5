"""Names of a package imported on first use (PEP 562), so that importing one of its modules does not
import the others (and torch with them).

Example::

    __getattr__ = lazy_names(__name__, {"start": "runtime"})   # package.start imports package.runtime
    __getattr__ = lazy_names(__name__, {"Ring": "commlens.ring"})  # a name of another package
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_names(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``homes[name]`` (a module of ``package``, or one
    named whole: ``commlens.…``) the first time ``name`` is used."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home if home.startswith("commlens.") else f"{package}.{home}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
