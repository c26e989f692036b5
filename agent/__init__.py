"""commlens.agent — the sidecar, its configuration, the CLI and the demo.

Example::

    import commlens.agent
    commlens.agent.start()   # hooks + sidecar + exporters, configured from the environment
    ...
    commlens.agent.stop()

Names are imported on first use, so that the sidecar's modules can be imported without torch.
"""

import importlib

_HOMES = {"Config": "config", "ConfigError": "config", "current": "runtime", "start": "runtime", "stop": "runtime"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'commlens.agent' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
