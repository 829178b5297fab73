"""Assembling and running an orchestrator process.

:func:`start` builds the store, the replica pools, the scheduler, the round
runner and the gRPC server (the shared factory: health, reflection, error
interceptor, port 0 support). The server's "model" is the tokenizer: health says
NOT_SERVING until it is loaded, like a replica loading its weights.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc.aio

from specserve.orchestrator.api import admission
from specserve.orchestrator.api.api_keys import AuthInterceptor, KeysFile
from specserve.orchestrator.api.generation import Orchestrator
from specserve.orchestrator.api.service import GenerationServicer
from specserve.orchestrator.api.text import Tokenization
from specserve.orchestrator.config import OrchestratorConfig
from specserve.orchestrator.fleet.replicas import ReplicaPool
from specserve.orchestrator.fleet.scheduler import Scheduler
from specserve.orchestrator.metrics import serve_metrics
from specserve.orchestrator.round.runner import RoundRunner
from specserve.orchestrator.snapshots.kv_snapshots import KvSnapshots
from specserve.orchestrator.snapshots.kv_store import ChunkStore
from specserve.orchestrator.store.redis_settings import embedded_client
from specserve.orchestrator.store.session_store import SessionStore
from specserve.policy import Planner
from specserve.serving.replica_connection import ReplicaConnection
from specserve.serving.server import RunningServer, identity_of, start_server
from specserve.telemetry.process import setup_telemetry
from specserve.telemetry.tracing import client_interceptors, instrument_redis
from specserve.v1 import draft_pb2_grpc, generate_pb2, generate_pb2_grpc, target_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def load_tokenization(spec: str | None) -> Tokenization:
    """The tokenizer of a model spec; none for ``tiny:`` test models or no spec."""
    if not spec:
        return Tokenization(None)
    from specserve import model_store
    from specserve.engine.loader import load_spec_tokenizer

    return Tokenization(load_spec_tokenizer(spec, locate=model_store.locate))


@dataclass
class App:
    """A started orchestrator and everything it owns."""

    config: OrchestratorConfig
    running: RunningServer[Tokenization]
    orchestrator: Orchestrator
    runner: RoundRunner
    store: SessionStore
    drafts: ReplicaPool
    targets: ReplicaPool
    metrics_port: int | None = None

    @property
    def address(self) -> str:
        return self.running.address

    async def close(self, grace_s: float = 0.0) -> None:
        """Stop serving, then everything else."""
        await self.running.stop(grace_s)
        await self.shutdown()

    async def shutdown(self) -> None:
        """End the sessions still decoding and close the pools and the store."""
        await self.runner.close()
        if self.runner.snapshots is not None:
            await self.runner.snapshots.close()
        for pool in (self.drafts, self.targets):
            await pool.close()
        await self.store.close()


async def start(config: OrchestratorConfig) -> App:
    """Start an orchestrator in this event loop."""
    tracing = config.server.telemetry.tracing
    if config.redis is None:
        store = SessionStore(embedded_client(), config.ttls, where="embedded store")
    else:
        store = SessionStore(
            config.redis.client(),
            config.ttls,
            where=config.redis.display,
            retry_s=config.redis_retry_s,
        )
    instrument_redis(store.redis, tracing)
    interceptors = client_interceptors(tracing)
    drafts = ReplicaPool(
        "draft",
        config.drafts,
        draft_pb2_grpc.DraftServiceStub,
        refresh_s=config.dns_refresh_s,
        interceptors=interceptors,
        tls=config.replica_tls,
        connection_factory=ReplicaConnection.propose,  # rounds over the data-plane sockets
        internal_token=config.internal_token,
    )
    targets = ReplicaPool(
        "target",
        config.targets,
        target_pb2_grpc.TargetServiceStub,
        refresh_s=config.dns_refresh_s,
        interceptors=interceptors,
        tls=config.replica_tls,
        connection_factory=ReplicaConnection.verify,
        internal_token=config.internal_token,
    )
    await drafts.start()
    await targets.start()
    snapshots = None
    if config.snapshots.enabled:
        snapshots = KvSnapshots(config.snapshots, _chunk_store(config, store), targets)
    runner = RoundRunner(
        Scheduler(config.scheduler),
        drafts,
        targets,
        store,
        config.timeouts,
        snapshots,
        Planner(config.policy),
    )
    holder: list[RunningServer[Tokenization]] = []
    orchestrator = Orchestrator(
        store,
        runner,
        lambda: holder[0].executor.backend,
        model_name=config.model_name,
        limits=config.admission,
    )

    keys = KeysFile(config.api_keys_file) if config.api_keys_file else None

    def register(server: grpc.aio.Server, running: RunningServer[Tokenization]) -> None:
        holder.append(running)
        servicer = GenerationServicer(orchestrator, keys)
        generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)

    running = await start_server(
        config.server,
        "orchestrator",
        lambda: load_tokenization(config.tokenizer),
        register,
        [SERVICE_NAME],
        interceptors=[AuthInterceptor(keys)] if keys is not None else [],
        request_bytes={
            f"/{SERVICE_NAME}/{method}": admission.request_bytes(config.admission)
            for method in ("Generate", "GenerateStream")
        },
    )
    log.info(
        "public API: %s, %s; replicas: %s%s",
        "TLS" if config.server.tls else "plaintext",
        f"{len(keys.keys)} API keys" if keys is not None else "no API key needed",
        "mutual TLS"
        if config.replica_tls and config.replica_tls.cert_file
        else "TLS"
        if config.replica_tls
        else "plaintext",
        ", internal token" if config.internal_token else "",
    )
    metrics_port = None
    if config.metrics_port is not None:
        metrics_port = serve_metrics(
            runner, orchestrator.stats, config.server.host, config.metrics_port
        )
    return App(config, running, orchestrator, runner, store, drafts, targets, metrics_port)


def _chunk_store(config: OrchestratorConfig, store: SessionStore) -> ChunkStore:
    """Where KV snapshot chunks go: their own Redis if one is given, else the session store's."""
    ttl = config.snapshots.ttl_s
    if config.snapshot_redis is None:
        return ChunkStore(store.redis, ttl, where=store.where)
    redis = config.snapshot_redis
    return ChunkStore(redis.client(), ttl, where=redis.display, owned=True)


def run(config: OrchestratorConfig) -> int:
    """An orchestrator process's main: serve until SIGTERM/SIGINT, then flush the spans."""
    identity = identity_of(config.server, "orchestrator", config.model_name)
    telemetry = setup_telemetry(config.server.telemetry, identity)
    for warning in config.warnings:
        log.warning("%s", warning)

    async def main() -> int:
        app = await start(config)
        try:
            await app.store.ping()
        except Exception as e:  # serve anyway: calls fail UNAVAILABLE until it is back
            log.warning("the session store is not reachable yet: %s", e)
        app.running.announce()
        if app.metrics_port is not None:
            print(
                f"orchestrator metrics on http://{config.server.host}:{app.metrics_port}/metrics",
                flush=True,
            )
        code = await app.running.serve_until_stopped()  # stops the gRPC server
        await app.shutdown()
        return code

    try:
        return asyncio.run(main())
    finally:
        telemetry.shutdown()
