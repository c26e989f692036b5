"""commlens.agent — the runtime that exports (its modules here: the sidecar, its configuration, the
exporters' pipeline, the pod sidecar), and two wings beside it: ``verdicts`` (facts, their readers, the
detectors, diagnose, timeline, report) and ``cli`` (the ``commlens`` command, ``commlens run``, the demo).
The runtime imports neither wing; the verdicts import nothing of the runtime (``tests/test_layout.py``).

Example::

    import commlens.agent
    commlens.agent.start()   # hooks + sidecar + exporters, configured from the environment
    ...
    commlens.agent.stop()

Names are imported on first use, so that the sidecar's modules can be imported without torch.
"""

from commlens.hooks.lazy import lazy_names

_HOMES = {"Config": "config", "ConfigError": "config", "current": "runtime", "start": "runtime", "stop": "runtime"}

__all__ = sorted(_HOMES)
__getattr__ = lazy_names(__name__, _HOMES)
