"""``specserve target-server``: the target replica's process.

Binds first (health NOT_SERVING), loads the target model on the model thread,
then serves Prefill / Verify / Release / GetLoad / ExportKv / ImportKv with health
SERVING. With ``--tp N`` the model is split over N ranks
(:mod:`specserve.target_service.tp_serving`): this process is rank 0, or, under
torchrun, a worker rank that serves nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import grpc.aio

from specserve.engine.kv_chunks import digest_key_of
from specserve.engine.kv_transfer import KvTransfer
from specserve.engine.step_runner import StepOptions
from specserve.engine.verifier import TargetVerifier
from specserve.serving.cli_args import parse_config
from specserve.serving.metrics import serve_replica_metrics
from specserve.serving.models import load_model
from specserve.serving.server import RunningServer, identity_of, run_process, start_server
from specserve.serving.supervision import stop_with_parent
from specserve.target_service import config as target_config
from specserve.target_service.backend import TargetBackend
from specserve.target_service.config import TargetServerConfig
from specserve.target_service.metrics import TargetCollector
from specserve.target_service.servicer import TargetServicer
from specserve.target_service.tp_config import is_torchrun, is_torchrun_worker
from specserve.target_service.tp_serving import GroupWatch, exit_now, serve_worker_rank
from specserve.v1 import target_pb2, target_pb2_grpc

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


def load_backend(config: TargetServerConfig) -> TargetBackend:
    """Load the target model and its KV pool (runs on the model thread)."""
    loaded = load_model(
        config.model,
        config.dtype,
        device=config.device,
        fail_after=config.fail_after_forwards,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
    )
    steps = (
        StepOptions(capture=config.cuda_graphs, batch_invariant=config.batch_invariant)
        if loaded.model.device.type == "cuda"
        else None
    )
    verifier = TargetVerifier(
        loaded.model, config.kv_budget_bytes, vocab_limit=loaded.vocab, steps=steps
    )
    # An ExportKv answer's chunk data stays a little under the message limit.
    kv = KvTransfer.for_model(
        loaded.model,
        verifier.kv,
        verifier.vocab_limit,
        max_export_bytes=config.server.max_message_bytes - (1 << 20),
        digest_key=digest_key_of(config.server.internal_token),
    )
    return TargetBackend(verifier, model_name=config.model, dtype=config.dtype, kv_transfer=kv)


async def start(
    config: TargetServerConfig, load: Callable[[], TargetBackend] | None = None
) -> RunningServer[TargetBackend]:
    """Start a target server in this event loop; ``load`` replaces the model load (tests).

    With ``--tp N`` (N > 1) this process is rank 0: the model thread joins or starts
    the rank group, and a watch ends the process once the group fails.
    """

    servicers: list[TargetServicer] = []

    def register(server: grpc.aio.Server, running: RunningServer[TargetBackend]) -> None:
        servicers.append(TargetServicer(running))
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicers[0], server)

    watch = GroupWatch(config) if load is None and config.tp.world_size > 1 else None
    if load is None:
        load = watch.load if watch is not None else (lambda: load_backend(config))
    running = await start_server(config.server, "target", load, register, [SERVICE_NAME])
    await running.serve_data_plane(servicers[0].verify_stream, target_pb2.VerifyRequest)
    serve_replica_metrics(running, "target", [TargetCollector(servicers[0].counts)])
    if watch is not None:
        running.watch(watch.run(running))
    return running


def build_parser(prog: str = "specserve target-server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=run.__doc__)
    target_config.add_arguments(parser)
    return parser


def run(config: TargetServerConfig) -> int:
    """Serve verification (Prefill / Verify / Release / GetLoad) until SIGTERM.

    A torchrun process of rank > 0 serves nothing: it mirrors rank 0's forwards.
    Every torchrun rank asks for SIGTERM when torchrun dies (torchrun does not ask for
    its ranks): rank 0 then drains and closes the group, and the other ranks, which
    ignore SIGTERM, leave with it.
    """
    if is_torchrun(config.tp):
        stop_with_parent()
    if is_torchrun_worker(config.tp):
        return serve_worker_rank(config)
    identity = identity_of(config.server, "target", config.model)
    code = run_process(lambda: start(config), config.server, identity)
    if code and config.tp.world_size > 1:
        exit_now(code)  # the group may be broken: skip the teardown it could hang
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specserve.target_service`` (the command torchrun starts on every rank)."""
    return run(parse_config(build_parser(), target_config.from_args, argv))
