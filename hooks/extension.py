"""commlens' C++ extensions (``_pg_hooks.cpp``, ``_ddp_hook.cpp``, ``_gpu.cpp``), built against the installed torch.

``load(source)`` returns the module built from ``source`` (a file next to this one), from the cache or
built into it under a file lock (docs/install.md); a failure raises with the compiler's output.
``load_or_warn`` is what the hooks call: None where it fails, and a one-line warning. ``ready()`` says,
without importing torch, whether every extension this torch takes was built (``mark_ready()``).

    hook = extension.load_or_warn("_ddp_hook.cpp", "C++ hook", "records ... with a Python hook",
                                  lambda module: module.init(...))
"""

from __future__ import annotations

import fcntl
import functools
import glob
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import warnings
from types import ModuleType
from typing import Callable

CFLAGS = ["-O3"]
"""-O3: the DDP hook's division and finiteness pass is vectorised (for AVX2 and AVX-512 too: its clones)."""
HERE = os.path.dirname(__file__)


@functools.cache
def _torch_build() -> bytes:
    """The installed torch's version and commit, read from its ``version.py`` without importing torch."""
    spec = importlib.util.spec_from_file_location(
        "_commlens_torch_version", os.path.join(importlib.util.find_spec("torch").submodule_search_locations[0],
                                                "version.py"))
    version = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(version)
    return f"{version.__version__} {version.git_version} {' '.join(CFLAGS)}".encode()


def _digest(*paths: str) -> str:
    """A name's suffix for ``paths`` (C++ sources), with the headers next to them, built with ``CFLAGS``
    against the installed torch."""
    digest = hashlib.sha256(_torch_build())
    for path in (*paths, *sorted(glob.glob(os.path.join(HERE, "*.h")))):
        with open(path, "rb") as text:
            digest.update(text.read())
    return digest.hexdigest()[:16]


def _cache(name: str) -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "commlens", name)


def _ready_path() -> str:
    return _cache(f"ready_{_digest(*sorted(glob.glob(os.path.join(HERE, '*.cpp'))))}")


def ready() -> bool:
    """Whether every extension this torch takes was built and loaded (``mark_ready``)."""
    return os.path.exists(_ready_path())


def mark_ready() -> None:
    open(_ready_path(), "a").close()


def load(source: str) -> ModuleType:
    path = os.path.join(HERE, source)
    name = f"commlens{os.path.splitext(source)[0]}_{_digest(path)}"
    cached = _cache(name + ".so")
    if not os.path.exists(cached):
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        with open(cached + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(cached):  # not built meanwhile by the process that held the lock
                _build(name, path, cached)
    spec = importlib.util.spec_from_file_location(name, cached)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, path: str, cached: str) -> None:
    from torch.utils import cpp_extension

    print(f"commlens: building its C++ extension {os.path.basename(path)} for this torch, once per machine "
          "(about 25 s)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as build:  # torch's lock file in a shared one outlives a killed builder
        cpp_extension.load(name, [path], extra_cflags=CFLAGS, build_directory=build)
        shutil.copyfile(os.path.join(build, name + ".so"), f"{cached}.{os.getpid()}")
        os.replace(f"{cached}.{os.getpid()}", cached)  # whole or absent


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
