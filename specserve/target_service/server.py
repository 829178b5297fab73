"""``specserve target-server``: the target replica's process.

Binds first (health NOT_SERVING), loads the target model on the model thread,
then serves Prefill / Verify / Release / GetLoad with health SERVING.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import grpc.aio

from specserve.engine.verifier import TargetVerifier
from specserve.serving.models import load_model
from specserve.serving.server import RunningServer, run_process, start_server
from specserve.target_service import config as target_config
from specserve.target_service.backend import TargetBackend
from specserve.target_service.config import TargetServerConfig
from specserve.target_service.servicer import TargetServicer
from specserve.v1 import target_pb2, target_pb2_grpc

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


def load_backend(config: TargetServerConfig) -> TargetBackend:
    """Load the target model and its KV pool (runs on the model thread)."""
    loaded = load_model(config.model, config.dtype, fail_after=config.fail_after_forwards)
    verifier = TargetVerifier(loaded.model, config.kv_budget_bytes, vocab_limit=loaded.vocab)
    return TargetBackend(verifier, model_name=config.model, dtype=config.dtype)


async def start(
    config: TargetServerConfig, load: Callable[[], TargetBackend] | None = None
) -> RunningServer[TargetBackend]:
    """Start a target server in this event loop; ``load`` replaces the model load (tests)."""

    def register(server: grpc.aio.Server, running: RunningServer[TargetBackend]) -> None:
        target_pb2_grpc.add_TargetServiceServicer_to_server(TargetServicer(running), server)

    return await start_server(
        config.server,
        "target",
        load or (lambda: load_backend(config)),
        register,
        [SERVICE_NAME],
    )


def build_parser(prog: str = "specserve target-server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=run.__doc__)
    target_config.add_arguments(parser)
    return parser


def run(config: TargetServerConfig) -> int:
    """Serve verification (Prefill / Verify / Release / GetLoad) until SIGTERM."""
    return run_process(lambda: start(config), config.server)


def main(argv: Sequence[str] | None = None) -> int:
    return run(target_config.from_args(build_parser().parse_args(argv)))
