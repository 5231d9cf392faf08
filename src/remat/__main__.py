"""``python -m remat``: the same command as ``remat`` (see :mod:`remat.cli`)."""

import sys

from remat.cli import main

sys.exit(main())
