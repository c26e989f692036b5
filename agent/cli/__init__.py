"""commlens' command line: ``commlens run``, ``sidecar``, ``demo``, ``dump``, ``assets``, and the verdicts'
readers (``diagnose``, ``timeline``, ``report``) by name. ``main`` is the ``commlens`` command."""

from .command import main

__all__ = ["main"]
