"""commlens.agent — the sidecar, its configuration, the CLI and the demo.

Example::

    import commlens.agent
    commlens.agent.start()   # hooks + sidecar + exporters, configured from the environment
    ...
    commlens.agent.stop()
"""

from .config import Config, ConfigError
from .runtime import current, start, stop

__all__ = ["Config", "ConfigError", "current", "start", "stop"]
