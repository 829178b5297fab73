"""Command-line flags every server shares, with ``SPECSERVE_*`` environment defaults.

The environment is read here, while the parser is built, and nowhere deeper: each
server's ``__main__`` turns the parsed flags into its one frozen config.

========================  ==============================  =========================
flag                      environment                     default
========================  ==============================  =========================
``--host``                ``SPECSERVE_HOST``              127.0.0.1
``--port``                ``SPECSERVE_PORT``              0 (ephemeral)
``--port-file``           ``SPECSERVE_PORT_FILE``         none
``--batch-window-ms``     ``SPECSERVE_BATCH_WINDOW_MS``   2
``--max-batch-sessions``  ``SPECSERVE_MAX_BATCH_SESSIONS`` 256
``--max-message-bytes``   ``SPECSERVE_MAX_MESSAGE_BYTES`` 64MiB
``--max-in-flight-bytes`` ``SPECSERVE_MAX_IN_FLIGHT_BYTES`` 16x the message limit
``--grace-s``             ``SPECSERVE_GRACE_S``           10
``--replica-id``          ``SPECSERVE_REPLICA_ID``        host:port
``--threads``             ``SPECSERVE_THREADS``           torch's default
``--device``              ``SPECSERVE_DEVICE``            cpu (``cuda``, ``cuda:N``)
``--dtype``               ``SPECSERVE_DTYPE``             float32; draft: bfloat16; CUDA: bfloat16
``--kv-budget``           ``SPECSERVE_KV_BUDGET``         per server
``--tls-cert/-key``       ``SPECSERVE_TLS_CERT/KEY``      none (plaintext)
``--tls-ca``              ``SPECSERVE_TLS_CA``            none (any client)
``--internal-token-file`` ``SPECSERVE_INTERNAL_TOKEN_FILE`` none (any caller)
``--health-port``         ``SPECSERVE_HEALTH_PORT``       none
``--data-port``           ``SPECSERVE_DATA_PORT``         0 (ephemeral; ``off``: none)
``--prefill-chunk-tokens`` ``SPECSERVE_PREFILL_CHUNK_TOKENS`` 512 (0: no chunking)
========================  ==============================  =========================

With ``--tls-ca`` a replica accepts only clients presenting a certificate from that CA
(mutual TLS; :mod:`specserve.serving.tls`); with ``--internal-token-file`` (or the token
in ``SPECSERVE_INTERNAL_TOKEN``) only calls carrying the deployment's internal token
(:mod:`specserve.serving.internal_token`).

and the telemetry flags of :mod:`specserve.telemetry.config` (tracing, logs,
``--metrics-port``), which the orchestrator takes as well.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from specserve.engine.devices import (
    CUDA_DEFAULT_DTYPE,
    check_device_name,
    default_dtype,
    parse_device,
)
from specserve.engine.dtypes import DTYPE_NAMES
from specserve.engine.errors import EngineError, InvalidArgument
from specserve.engine.model import DEFAULT_PREFILL_CHUNK_TOKENS
from specserve.serving.internal_token import add_internal_token_argument, internal_token
from specserve.serving.server import MAX_MESSAGE_BYTES, ServerOptions
from specserve.serving.tls import add_tls_arguments, server_tls
from specserve.telemetry.config import add_telemetry_arguments, telemetry_config

_UNITS = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` or a plain number of bytes -> bytes."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 1000000)")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size must be at least 1 byte, got {text!r}")
    return int(value)


def _env(env: Mapping[str, str], name: str, default: object) -> object:
    return env.get(f"SPECSERVE_{name}", default)


def add_server_arguments(
    parser: argparse.ArgumentParser,
    *,
    kv_budget: str,
    dtype: str = "float32",
    env: Mapping[str, str] | None = None,
) -> None:
    """Add the shared flags; ``kv_budget`` is this server's default KV budget (e.g. "2GiB")
    and ``dtype`` its default weight dtype."""
    env = os.environ if env is None else env
    g = parser.add_argument_group("serving")
    g.add_argument(
        "--host",
        default=_env(env, "HOST", "127.0.0.1"),
        help="address to bind (default loopback only; 0.0.0.0 in a container, with TLS)",
    )
    g.add_argument(
        "--port",
        type=int,
        default=int(str(_env(env, "PORT", 0))),
        help="port to bind; 0 picks a free one (see --port-file)",
    )
    g.add_argument(
        "--port-file",
        default=_env(env, "PORT_FILE", None),
        help="write the bound port to this file once listening",
    )
    g.add_argument(
        "--batch-window-ms",
        type=float,
        default=float(str(_env(env, "BATCH_WINDOW_MS", 2.0))),
        help="how long a lone call waits for others to share its forward",
    )
    g.add_argument(
        "--max-batch-sessions",
        type=int,
        default=int(str(_env(env, "MAX_BATCH_SESSIONS", 256))),
        help="most sessions coalesced into one forward",
    )
    g.add_argument(
        "--max-message-bytes",
        type=parse_bytes,
        default=str(_env(env, "MAX_MESSAGE_BYTES", MAX_MESSAGE_BYTES)),  # parsed like the flag
        help="largest request or response (default 64MiB)",
    )
    g.add_argument(
        "--max-in-flight-bytes",
        type=parse_bytes,
        default=_env(env, "MAX_IN_FLIGHT_BYTES", None),  # a string: parsed like the flag
        help="request bytes the calls in flight may hold together: past it no data-plane "
        "connection is read further and a unary Propose / Verify / Prefill / ImportKv is "
        "refused (default 16x --max-message-bytes)",
    )
    g.add_argument(
        "--grace-s",
        type=float,
        default=float(str(_env(env, "GRACE_S", 10.0))),
        help="on SIGTERM, how long in-flight calls get to finish",
    )
    g.add_argument(
        "--replica-id",
        default=_env(env, "REPLICA_ID", ""),
        help="id reported in GetLoad (default host:port)",
    )
    threads = _env(env, "THREADS", None)
    g.add_argument(
        "--threads",
        type=int,
        default=int(str(threads)) if threads else None,
        help="torch intra-op threads (tests use 1)",
    )
    g.add_argument(
        "--device",
        default=_env(env, "DEVICE", "cpu"),
        help="where the model computes: cpu, cuda or cuda:N (default cpu; a device this "
        "machine lacks is refused at start-up)",
    )
    g.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=_env(env, "DTYPE", None),
        help=f"weight dtype (default {dtype} on a CPU, {CUDA_DEFAULT_DTYPE} on CUDA; bfloat16 "
        "on a CPU with the engine's kernels: bfloat16 weights, float32 compute and KV)",
    )
    g.add_argument(
        "--kv-budget",
        type=parse_bytes,
        default=str(_env(env, "KV_BUDGET", kv_budget)),  # parsed like the flag
        help=f"KV cache memory budget (default {kv_budget})",
    )
    g.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=int(str(_env(env, "PREFILL_CHUNK_TOKENS", DEFAULT_PREFILL_CHUNK_TOKENS))),
        help="a long prompt runs through the model this many tokens at a time, so "
        "attention memory grows linearly with it (0: in one forward)",
    )
    g.add_argument(
        "--fail-after-forwards",
        type=int,
        default=None,
        metavar="N",
        help="testing: simulate a device failure after N model forwards",
    )
    add_tls_arguments(parser, env, role="replica")
    add_internal_token_argument(parser, env)
    add_health_port_argument(parser, env)
    parser.add_argument(
        "--data-port",
        type=data_port,
        default=data_port(str(_env(env, "DATA_PORT", "0"))),
        help="port of the data-plane socket (the orchestrator's Propose / Verify calls; "
        "GetLoad reports it); 0 picks a free one, off serves none: the orchestrator then "
        "cannot send this replica rounds (default 0)",
    )
    add_telemetry_arguments(parser, env)


def data_port(text: str) -> int | None:
    """``--data-port``: a port number, or ``off`` (None)."""
    if text.strip().lower() == "off":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--data-port takes a port number or off, got {text!r}"
        ) from None


def add_health_port_argument(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """``--health-port``: health alone on a plaintext port, for probes that cannot do TLS."""
    port = _env(env, "HEALTH_PORT", None)
    parser.add_argument(
        "--health-port",
        type=int,
        default=int(str(port)) if port else None,
        help="also serve the health service alone, plaintext, on this port (Kubernetes "
        "gRPC probes cannot speak TLS); default: none",
    )


def device_and_dtype(
    args: argparse.Namespace, cpu_dtype: str, *, check_machine: bool = True
) -> tuple[str, str]:
    """The server's device name and weight dtype from ``--device`` and ``--dtype`` (unset:
    ``cpu_dtype`` on a CPU, bfloat16 on CUDA). With ``check_machine`` the device must
    exist here (:func:`~specserve.engine.devices.parse_device`); without it only its name
    is checked (a launcher whose ranks run elsewhere). InvalidArgument otherwise."""
    name = check_device_name(args.device)
    if check_machine:
        parse_device(name)
    return name, args.dtype or default_dtype(name, cpu_dtype)


@dataclass(frozen=True)
class PairPlacement:
    """Where a target and a draft run, and in which weight dtype (one process or ``up``)."""

    target_device: str
    draft_device: str
    target_dtype: str
    draft_dtype: str


def add_pair_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` (both models) and ``--draft-device`` (the draft, if elsewhere)."""
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the models compute: cpu, cuda or cuda:N (default cpu)",
    )
    parser.add_argument(
        "--draft-device",
        default=None,
        help="the draft's device, if not --device (e.g. cuda:1 beside a target on cuda:0)",
    )


def pair_placement(
    device: str, draft_device: str | None, target_dtype: str | None, draft_dtype: str | None
) -> PairPlacement:
    """Both devices checked against this machine (InvalidArgument, one sentence, before
    anything loads); an unset dtype is the device's default (float32 for a target and
    bfloat16 for a draft on a CPU, bfloat16 on CUDA)."""
    target_at = check_device_name(device)
    draft_at = check_device_name(draft_device or device)
    parse_device(target_at)
    parse_device(draft_at)
    return PairPlacement(
        target_at,
        draft_at,
        target_dtype or default_dtype(target_at, "float32"),
        draft_dtype or default_dtype(draft_at, "bfloat16"),
    )


def server_options(args: argparse.Namespace) -> ServerOptions:
    """The shared part of a server's config, from parsed flags."""
    return ServerOptions(
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        max_message_bytes=args.max_message_bytes,
        batch_window_ms=args.batch_window_ms,
        max_batch_sessions=args.max_batch_sessions,
        grace_s=args.grace_s,
        replica_id=args.replica_id,
        threads=args.threads,
        tls=server_tls(args, check_clients=True),
        health_port=args.health_port,
        data_port=args.data_port,
        max_in_flight_bytes=args.max_in_flight_bytes,
        telemetry=telemetry_config(args),
        internal_token=internal_token(args),
    )


Config = TypeVar("Config")


def flag_values(
    process: str,
) -> Callable[[Callable[[argparse.Namespace], Config]], Callable[[argparse.Namespace], Config]]:
    """Decorates a ``from_args``: a flag value its config refuses (ValueError) becomes
    InvalidArgument("bad <process> flags: ..."), which the command line prints as one
    line (:func:`parse_config`, ``specserve``'s main)."""

    def wrap(
        build: Callable[[argparse.Namespace], Config],
    ) -> Callable[[argparse.Namespace], Config]:
        @functools.wraps(build)
        def from_args(args: argparse.Namespace) -> Config:
            try:
                return build(args)
            except ValueError as e:
                raise InvalidArgument(f"bad {process} flags: {e}") from None

        return from_args

    return wrap


def parse_config(
    parser: argparse.ArgumentParser,
    from_args: Callable[[argparse.Namespace], Config],
    argv: Sequence[str] | None = None,
) -> Config:
    """A process's config from its command line (``python -m`` entry points): a bad
    flag value exits 2 with one line naming it, as argparse does for a bad flag."""
    args = parser.parse_args(argv)
    try:
        return from_args(args)
    except EngineError as e:
        parser.error(str(e))
