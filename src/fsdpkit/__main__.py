"""``python -m fsdpkit`` is the ``fsdpkit`` command."""

import sys

from fsdpkit.cli import main

sys.exit(main())
