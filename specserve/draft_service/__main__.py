"""``python -m specserve.draft_service``: the same as ``specserve draft-server``."""

import sys

from specserve.draft_service.server import main

sys.exit(main())
