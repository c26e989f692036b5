"""``python -m commlens.agent.cli``: the ``commlens`` command."""

import sys

from .command import main

sys.exit(main())
