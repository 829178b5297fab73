"""A bare grpc.aio server: the health service alone, no interceptors, no specserve code.

``bench.rpc_overhead`` times its ``Check`` beside the real servers' calls, as the
floor that Python gRPC itself sets for one unary call on this machine.

    python -m bench.bare_grpc --host 127.0.0.1 --port 0 --port-file FILE
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from pathlib import Path

import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio


async def serve(host: str, port: int, port_file: Path | None) -> None:
    server = grpc.aio.server()
    health = health_aio.HealthServicer()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    if port_file is not None:
        port_file.write_text(str(bound))
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file", type=Path, default=None)
    args = p.parse_args(argv)
    asyncio.run(serve(args.host, args.port, args.port_file))


if __name__ == "__main__":
    main()
