"""``python -m specserve.orchestrator``: the same as ``specserve orchestrator``."""

import argparse
import sys

from specserve.orchestrator import app, config
from specserve.serving.cli_args import parse_config


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="specserve orchestrator", description="Serve the public Generation API."
    )
    config.add_arguments(parser)
    return app.run(parse_config(parser, config.from_args))


sys.exit(main())
