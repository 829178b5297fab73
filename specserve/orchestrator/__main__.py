"""``python -m specserve.orchestrator``: the same as ``specserve orchestrator``."""

import argparse
import sys

from specserve.engine.errors import EngineError
from specserve.orchestrator import app, config


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="specserve orchestrator", description="Serve the public Generation API."
    )
    config.add_arguments(parser)
    args = parser.parse_args()
    try:
        settings = config.from_args(args)
    except EngineError as e:  # a bad flag value: say which, no traceback
        parser.error(str(e))
    return app.run(settings)


sys.exit(main())
