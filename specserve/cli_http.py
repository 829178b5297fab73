"""``specserve http-server``: the OpenAI-compatible HTTP API in front of an orchestrator."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from specserve.openai_api import config

    p = sub.add_parser(
        "http-server",
        help="serve the OpenAI-compatible HTTP API over an orchestrator",
        description="POST /v1/completions and /v1/chat/completions (streaming or not), "
        "GET /v1/models, /health and /metrics, each request sent to --orchestrator's gRPC API.",
    )
    config.add_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from specserve.openai_api import config, server

    return server.run(config.from_args(args))
