"""``specserve draft-server``: the draft replica's process.

Binds first (health NOT_SERVING), loads the draft model on the model thread, then
serves Propose / Release / GetLoad with health SERVING.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import grpc.aio

from specserve.draft_service import config as draft_config
from specserve.draft_service.backend import DraftBackend
from specserve.draft_service.config import DraftServerConfig
from specserve.draft_service.metrics import DraftCollector
from specserve.draft_service.servicer import DraftServicer
from specserve.engine.draft_ahead import AheadCounts
from specserve.engine.draft_vocab import reduce_draft_head
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.step_runner import StepOptions
from specserve.serving.cli_args import parse_config
from specserve.serving.metrics import serve_replica_metrics
from specserve.serving.models import load_model
from specserve.serving.server import RunningServer, identity_of, run_process, start_server
from specserve.v1 import draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


def load_backend(config: DraftServerConfig) -> DraftBackend:
    """Build the drafters (runs on the model thread)."""
    if config.model is None:
        return DraftBackend(None, model_name="ngram", dtype=config.dtype, vocab=2**31 - 1)
    loaded = load_model(
        config.model,
        config.dtype,
        device=config.device,
        fail_after=config.fail_after_forwards,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
    )
    reduce_draft_head(loaded.model, loaded.tokenizer, config.draft_vocab, loaded.vocab)
    drafter = ModelDrafter(
        loaded.model,
        config.kv_budget_bytes,
        max_support=config.max_support,
        min_confidence=config.min_confidence,
        vocab_limit=loaded.vocab,
        draft_ahead=config.draft_ahead,
        steps=(
            StepOptions(capture=config.cuda_graphs) if loaded.model.device.type == "cuda" else None
        ),
    )
    return DraftBackend(drafter, model_name=config.model, dtype=config.dtype, vocab=loaded.vocab)


async def start(
    config: DraftServerConfig, load: Callable[[], DraftBackend] | None = None
) -> RunningServer[DraftBackend]:
    """Start a draft server in this event loop; ``load`` replaces the model load (tests)."""

    servicers: list[DraftServicer] = []

    def register(server: grpc.aio.Server, running: RunningServer[DraftBackend]) -> None:
        servicers.append(DraftServicer(running))
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicers[0], server)

    running = await start_server(
        config.server,
        "draft",
        load or (lambda: load_backend(config)),
        register,
        [SERVICE_NAME],
    )
    await running.serve_data_plane(servicers[0].propose_stream, draft_pb2.ProposeRequest)

    def ahead_counts() -> AheadCounts | None:
        backend = running.executor.loaded_backend
        model = backend.model if backend is not None else None
        return model.ahead_counts if isinstance(model, ModelDrafter) else None

    collector = DraftCollector(servicers[0].counts, ahead_counts)
    serve_replica_metrics(running, "draft", [collector])
    return running


def build_parser(prog: str = "specserve draft-server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=run.__doc__)
    draft_config.add_arguments(parser)
    return parser


def run(config: DraftServerConfig) -> int:
    """Serve draft proposals (Propose / Release / GetLoad) until SIGTERM."""
    identity = identity_of(config.server, "draft", config.model or "ngram")
    return run_process(lambda: start(config), config.server, identity)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specserve.draft_service``."""
    return run(parse_config(build_parser(), draft_config.from_args, argv))
