"""Running the HTTP server: uvicorn (httptools parser) in this process's asyncio loop.

:func:`serve` binds the socket itself, so ``--port 0`` works and the bound port can
be written to ``--port-file`` before requests arrive; uvicorn handles SIGINT/SIGTERM
with a graceful shutdown (in-flight streams finish or are cancelled with their
connections).
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import uvicorn

from specserve.openai_api.app import build_app
from specserve.openai_api.config import HttpServerConfig
from specserve.telemetry.process import setup_telemetry
from specserve.telemetry.tracing import ServiceIdentity


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0 = an ephemeral one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve(config: HttpServerConfig) -> None:
    """Serve until SIGINT/SIGTERM."""
    sock = bind(config.host, config.port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(config),
            http="httptools",
            loop="none",  # this loop, as asyncio.run made it
            lifespan="on",
            log_level=config.telemetry.logs.level.lower(),
            access_log=False,
        )
    )
    if config.port_file:
        Path(config.port_file).write_text(str(port))
    print(
        f"OpenAI-compatible HTTP API on http://{config.host}:{port}/v1 "
        f"(orchestrator {config.orchestrator}{' over TLS' if config.tls else ''}, "
        f"model {config.served_model_name})",
        flush=True,
    )
    await server.serve(sockets=[sock])


def run(config: HttpServerConfig) -> int:
    """The process's main: telemetry once, serve, flush the spans."""
    telemetry = setup_telemetry(config.telemetry, ServiceIdentity("http", config.served_model_name))
    try:
        asyncio.run(serve(config))
    finally:
        telemetry.shutdown()
    return 0
