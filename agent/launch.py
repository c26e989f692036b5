"""``commlens run [options] -- COMMAND…``: run a command with commlens in every distributed rank it starts.

It puts a ``sitecustomize`` module (``agent/autostart/``) first on ``PYTHONPATH``; Python imports it
at start-up in every process of the command's tree. In a process that is a distributed rank (``RANK``
is set, as torchrun and the other launchers set it) it starts ``commlens.agent`` and stops it, flushing,
at exit; every other process (torchrun's own agent, data-loader workers started with ``RANK`` unset,
tools) is left alone. A ``sitecustomize`` the job had is still imported after ours.

Example::

    commlens run --hang-threshold 120 -- torchrun --nproc-per-node 4 train.py
"""

from __future__ import annotations

import os
import subprocess
import sys

from .config import Config

AUTOSTART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "autostart")
MARKER = "COMMLENS_AUTOSTART"


def environment(base: dict[str, str], settings: dict[str, str]) -> dict[str, str]:
    """``base`` with the options applied, the marker set and our ``sitecustomize`` first on the path."""
    env = {**base, **settings, MARKER: "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [AUTOSTART, base.get("PYTHONPATH")]))
    return env


def run(command: list[str], settings: dict[str, str]) -> int:
    """Check the configuration as a rank would see it, then run ``command``; returns its exit status."""
    env = environment(dict(os.environ), settings)
    Config.from_env({**env, "RANK": env.get("RANK", "0")})  # a bad setting fails here, not in every rank
    try:
        return subprocess.call(command, env=env)
    except FileNotFoundError:
        print(f"commlens run: {command[0]!r} was not found", file=sys.stderr)
        return 127
