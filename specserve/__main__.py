"""``python -m specserve`` is the ``specserve`` command."""

import sys

from specserve.cli import main

sys.exit(main())
