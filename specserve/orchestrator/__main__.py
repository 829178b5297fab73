"""``python -m specserve.orchestrator``: the same as ``specserve orchestrator``."""

import argparse
import sys

from specserve.orchestrator import app, config


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="specserve orchestrator", description="Serve the public Generation API."
    )
    config.add_arguments(parser)
    return app.run(config.from_args(parser.parse_args()))


sys.exit(main())
