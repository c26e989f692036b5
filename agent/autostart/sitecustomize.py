"""Imported at start-up by every Python process that ``commlens run`` starts (see agent/cli/launch.py).

In a distributed rank it starts commlens; in any other process it does nothing. Telemetry never
stops the job: if commlens cannot start, the rank says why on stderr, leaves a note saying so in the
job's folder (``COMMLENS_NOT_STARTED``, set by ``commlens run``: the verdict then names the rank as
unobserved, never "nothing wrong found" alone) and trains without it.
"""

import os
import sys


def _start_in_rank() -> None:
    if os.environ.get("COMMLENS_AUTOSTART") != "1" or "RANK" not in os.environ:
        return
    import atexit

    try:
        import commlens.agent

        commlens.agent.start()
    except Exception as error:  # noqa: BLE001 — whatever it was, the job goes on without commlens
        rank = os.environ["RANK"]
        print(f"commlens: not started in rank {rank}: {error}", file=sys.stderr)
        _note(rank, error)
        return
    atexit.register(commlens.agent.stop)


def _note(rank: str, error: Exception) -> None:
    """The note that the verdict reads (agent/verdicts/readers/files.py: ``NOT_STARTED``)."""
    path = os.environ.get("COMMLENS_NOT_STARTED", "").replace("{rank}", rank)
    if not path:
        return
    import json

    from commlens.ring.dumps import attempt_path, current_attempt

    path = attempt_path(path, current_attempt())  # an elastic restart's attempt: in its own folder
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({"rank": int(rank), "error": str(error)}, f)
    except (OSError, ValueError) as failed:
        print(f"commlens: no note of it in {path}: {failed}", file=sys.stderr)


def _chain() -> None:
    """Import the ``sitecustomize`` this one shadows, if the job had one."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        import sitecustomize  # noqa: F401
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if ours is not None:
            sys.modules["sitecustomize"] = ours


_chain()
_start_in_rank()
