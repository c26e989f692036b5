"""commlens' command line: ``commlens run``, ``sidecar``, ``demo``, ``dump``, ``assets``, and the verdicts'
readers (``diagnose``, ``timeline``, ``report``) by name. ``main`` is the ``commlens`` command."""

from .main import main as main

__all__ = ["main"]
