"""commlens' C++ extensions (``_pg_hooks.cpp``, ``_ddp_hook.cpp``), built against the installed torch.

``load(source)`` returns the module built from ``source`` (a file next to this one): from the cache,
``$XDG_CACHE_HOME/commlens`` (default ``~/.cache/commlens``), else built into it by
``torch.utils.cpp_extension`` (about 15 s, once per machine, torch and source; it needs a C++ compiler
and ninja on PATH). A failure raises, the compiler's whole output in the error. ``load_or_warn`` is
what the hooks call: None where it fails, and a one-line warning that says what commlens does instead.

    hook = extension.load_or_warn("_ddp_hook.cpp", "C++ hook", "records ... with a Python hook",
                                  lambda module: module.init(...))
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import warnings
from types import ModuleType
from typing import Callable

import torch

CFLAGS = ["-O3"]
"""-O3: the DDP hook's division and finiteness pass is vectorised (for AVX2 and AVX-512 too: its clones)."""


def load(source: str) -> ModuleType:
    path = os.path.join(os.path.dirname(__file__), source)
    with open(path, "rb") as text:
        digest = hashlib.sha256(text.read() + torch.__version__.encode() + torch.version.git_version.encode()
                                + " ".join(CFLAGS).encode())
    name = f"commlens{os.path.splitext(source)[0]}_{digest.hexdigest()[:16]}"
    cached = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "commlens",
                          name + ".so")
    if not os.path.exists(cached):
        from torch.utils import cpp_extension

        with tempfile.TemporaryDirectory() as build:  # a directory of its own: no lock shared with other ranks
            cpp_extension.load(name, [path], extra_cflags=CFLAGS, build_directory=build)
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            shutil.copyfile(os.path.join(build, name + ".so"), f"{cached}.{os.getpid()}")
            os.replace(f"{cached}.{os.getpid()}", cached)  # whole or absent, whichever rank is first
    spec = importlib.util.spec_from_file_location(name, cached)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_or_warn(source: str, what: str, instead: str, init: Callable[[ModuleType], None]) -> ModuleType | None:
    """``load(source)``, then ``init`` it; where either fails: None, and the warning "commlens
    ``instead``: its ``what`` could not be built (the error's first line) ..."."""
    try:
        module = load(source)
        init(module)
        return module
    except Exception as error:  # the compiler's whole output is in the error: its first line says which step
        reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
        warnings.warn(f"commlens {instead}: its {what} could not be built ({reason}); that needs a C++ compiler and "
                      "ninja on PATH", RuntimeWarning, stacklevel=3)
        return None
