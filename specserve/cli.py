"""The ``specserve`` command: one subcommand per job or server."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specserve import __version__
from specserve.engine.errors import EngineError
from specserve.serving.supervision import StopSignal


def build_parser() -> argparse.ArgumentParser:
    from specserve import cli_generate, cli_http, cli_models, cli_orchestrator, cli_servers

    parser = argparse.ArgumentParser(
        prog="specserve", description="Speculative-decoding serving: draft, target, orchestrator."
    )
    parser.add_argument("--version", action="version", version=f"specserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cli_models.add_parser(sub)
    cli_generate.add_parser(sub)
    cli_servers.add_parsers(sub)
    cli_orchestrator.add_parsers(sub)
    cli_http.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EngineError as e:
        print(f"specserve: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except StopSignal as e:  # SIGTERM or SIGHUP to a launcher, after it stopped its children
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
