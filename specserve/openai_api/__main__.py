"""``python -m specserve.openai_api``: the same as ``specserve http-server``."""

import argparse
import sys

from specserve.openai_api import config, server
from specserve.serving.cli_args import parse_config


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="specserve http-server",
        description="Serve the OpenAI-compatible HTTP API over an orchestrator's gRPC API.",
    )
    config.add_arguments(parser)
    return server.run(parse_config(parser, config.from_args))


sys.exit(main())
