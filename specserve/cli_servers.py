"""``specserve draft-server`` and ``specserve target-server``: one subcommand per server."""

from __future__ import annotations

import argparse


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add both server subcommands to the ``specserve`` command's subparsers."""
    from specserve.draft_service import config as draft_config
    from specserve.target_service import config as target_config

    p = sub.add_parser(
        "draft-server",
        help="run a draft replica (gRPC DraftService)",
        description="Serve draft proposals (Propose / Release / GetLoad) until SIGTERM.",
    )
    draft_config.add_arguments(p)
    p.set_defaults(func=_run_draft)

    p = sub.add_parser(
        "target-server",
        help="run a target replica (gRPC TargetService)",
        description="Serve verification (Prefill / Verify / Release / GetLoad) until SIGTERM.",
    )
    target_config.add_arguments(p)
    p.set_defaults(func=_run_target)


def _run_draft(args: argparse.Namespace) -> int:
    from specserve.draft_service import config, server

    return server.run(config.from_args(args))


def _run_target(args: argparse.Namespace) -> int:
    from specserve.target_service import config, server

    return server.run(config.from_args(args))
