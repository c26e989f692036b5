"""``python -m commlens.agent.cli``: the ``commlens`` command."""

import sys

from .main import main

sys.exit(main())
