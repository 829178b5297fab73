"""The HTTP server's one config, built once from its flags (environment defaults).

Towards the orchestrator the server is a client like any other: the TLS flags are the
shared client ones (:func:`specserve.serving.tls.add_tls_arguments`, ``role="client"``):
``--tls-ca`` turns TLS on and is the CA the orchestrator's certificate must chain to,
``--tls-cert``/``--tls-key`` a client certificate to present, ``--tls-server-name`` the
name to check instead of the host dialled.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from specserve.serving.cli_args import flag_values, parse_bytes
from specserve.serving.tls import ClientTls, add_tls_arguments, client_tls
from specserve.telemetry.config import TelemetryConfig, add_telemetry_arguments, telemetry_config


@dataclass(frozen=True)
class HttpServerConfig:
    """``specserve http-server``: where to listen, which orchestrator to front."""

    orchestrator: str  # host:port of the public gRPC API
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = an ephemeral port (written to port_file)
    port_file: str | None = None
    served_model_name: str = "specserve"  # what /v1/models lists and requests must name
    max_choices: int = 16  # n times the prompts of one request
    timeout_s: float = 600.0  # each gRPC call's deadline
    # A request body's bytes, refused (413) before it is parsed past this. 8 MiB holds the
    # largest prompt the orchestrator takes: 131,072 token ids as JSON, or its 1 MiB of
    # text even escaped as \uXXXX.
    max_body_bytes: int = 8 << 20
    tls: ClientTls | None = None  # None = a plaintext channel to the orchestrator
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    def __post_init__(self) -> None:
        if not self.orchestrator:
            raise ValueError("--orchestrator is required: the host:port of the gRPC API")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not 1 <= self.max_choices <= 256:
            raise ValueError(f"max choices must be in 1..256, got {self.max_choices}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout_s}")
        if not 1 << 10 <= self.max_body_bytes <= 1 << 30:
            raise ValueError(f"max body bytes must be in 1KiB..1GiB, got {self.max_body_bytes}")
        if not self.served_model_name:
            raise ValueError("the served model name must not be empty")
        if self.telemetry.metrics_port is not None:
            raise ValueError("--metrics-port: the HTTP server serves /metrics on its own port")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ
    parser.add_argument(
        "--orchestrator",
        default=env.get("SPECSERVE_ORCHESTRATOR", ""),
        help="host:port of the orchestrator's gRPC API (env SPECSERVE_ORCHESTRATOR)",
    )
    parser.add_argument("--host", default=env.get("SPECSERVE_HTTP_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env.get("SPECSERVE_HTTP_PORT", 8000)))
    parser.add_argument("--port-file", default=None, help="write the bound port here")
    parser.add_argument(
        "--served-model-name",
        default=env.get("SPECSERVE_SERVED_MODEL_NAME", "specserve"),
        help="the model id /v1/models lists and requests name (set it as on the orchestrator)",
    )
    parser.add_argument(
        "--max-choices",
        type=int,
        default=16,
        help="at most this many choices (n x prompts) per request",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="deadline of each gRPC call, seconds"
    )
    parser.add_argument(
        "--max-body-bytes",
        type=parse_bytes,
        default=env.get("SPECSERVE_HTTP_MAX_BODY_BYTES", "8MiB"),  # parsed like the flag
        help="largest request body; a larger one is refused (413) before it is parsed "
        "(env SPECSERVE_HTTP_MAX_BODY_BYTES; default 8MiB)",
    )
    add_tls_arguments(parser, env, role="client")
    add_telemetry_arguments(parser)


@flag_values("http-server")
def from_args(args: argparse.Namespace) -> HttpServerConfig:
    """The config the parsed flags describe; a bad value raises ValueError (one line, exit 2)."""
    return HttpServerConfig(
        orchestrator=args.orchestrator,
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        served_model_name=args.served_model_name,
        max_choices=args.max_choices,
        timeout_s=args.timeout,
        max_body_bytes=args.max_body_bytes,
        tls=client_tls(args),
        telemetry=telemetry_config(args),
    )
