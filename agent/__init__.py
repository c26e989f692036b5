"""commlens.agent — the sidecar, its configuration, the CLI and the demo.

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
