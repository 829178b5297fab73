"""``python -m specserve.target_service``: the same as ``specserve target-server``."""

import sys

from specserve.target_service.server import main

sys.exit(main())
