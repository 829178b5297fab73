"""TLS for every gRPC server and channel: the ``--tls-cert``/``--tls-key``/``--tls-ca`` flags.

A server (draft, target, orchestrator) with ``--tls-cert`` and ``--tls-key`` serves TLS
only; with ``--tls-ca`` as well a *replica* accepts only clients that present a
certificate signed by that CA (mutual TLS), so no pod without one can call
``Verify``, ``Release``, ``ExportKv`` or ``ImportKv``. The orchestrator's own public
port never asks for a client certificate (its callers authenticate with API keys),
and on the orchestrator ``--tls-ca`` is the CA its replicas' certificates are checked
against; its certificate and key are what it presents to them.

A client (the orchestrator towards its replicas, :class:`specserve.client.Client`,
``specserve generate``) uses TLS when it is given a CA: it trusts only that CA, and
presents its certificate and key when it has them. ``server_name`` replaces the
host name the server's certificate is checked against (replicas found by DNS are
dialled by IP address, so their certificates name the service instead).

Files are read once, when a server or channel is made; a file that cannot be read or
holds no PEM block is an :class:`InvalidArgument` naming the flag.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from specserve.engine.errors import InvalidArgument

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "[::1]", "localhost"})


def read_pem(path: str, flag: str) -> bytes:
    """The bytes of a PEM file; InvalidArgument naming ``flag`` if unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InvalidArgument(f"cannot read {flag} {path!r}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise InvalidArgument(f"{flag} {path!r} holds no PEM block (-----BEGIN ...)")
    return data


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate and key, and the CA its clients' certificates must chain to."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None  # set: clients must present a certificate from this CA

    def credentials(self) -> grpc.ServerCredentials:
        cert = read_pem(self.cert_file, "--tls-cert")
        key = read_pem(self.key_file, "--tls-key")
        if self.client_ca_file is None:
            return grpc.ssl_server_credentials([(key, cert)])
        ca = read_pem(self.client_ca_file, "--tls-ca")
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )


@dataclass(frozen=True)
class ClientTls:
    """What a TLS client trusts (a CA) and presents (an optional certificate and key)."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None  # checked against the server's certificate instead of host

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a TLS client certificate needs its key, and a key its certificate")

    def credentials(self) -> grpc.ChannelCredentials:
        ca = read_pem(self.ca_file, "--tls-ca")
        cert = read_pem(self.cert_file, "--tls-cert") if self.cert_file else None
        key = read_pem(self.key_file, "--tls-key") if self.key_file else None
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def channel_options(self, server_name: str | None = None) -> list[tuple[str, Any]]:
        """``grpc.ssl_target_name_override`` when a name other than the host is checked."""
        name = self.server_name or server_name
        return [("grpc.ssl_target_name_override", name)] if name else []


def aio_channel(
    target: str,
    tls: ClientTls | None,
    *,
    options: list[tuple[str, Any]] | None = None,
    interceptors: Any = None,
    server_name: str | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel: TLS when ``tls`` is given, plaintext otherwise."""
    opts = list(options or [])
    if tls is None:
        return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)
    opts += tls.channel_options(server_name)
    return grpc.aio.secure_channel(
        target, tls.credentials(), options=opts, interceptors=interceptors
    )


def sync_channel(
    target: str, tls: ClientTls | None, *, options: list[tuple[str, Any]] | None = None
) -> grpc.Channel:
    """A blocking channel: TLS when ``tls`` is given, plaintext otherwise."""
    opts = list(options or [])
    if tls is None:
        return grpc.insecure_channel(target, options=opts)
    return grpc.secure_channel(target, tls.credentials(), options=opts + tls.channel_options())


def add_tls_arguments(
    parser: argparse.ArgumentParser, env: Mapping[str, str], *, role: str
) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca`` (``SPECSERVE_TLS_CERT``/``_KEY``/``_CA``).

    ``role`` words the help: "replica" (the CA checks client certificates), "orchestrator"
    (the CA checks the replicas' certificates) or "client".
    """
    ca_help = {
        "replica": "CA bundle: accept only clients whose certificate it signed (mutual TLS)",
        "orchestrator": "CA bundle the replicas' certificates must chain to; turns on TLS, "
        "with this process's --tls-cert/--tls-key as client certificate, towards them",
        "client": "CA bundle the server's certificate must chain to; turns TLS on",
    }[role]
    own = "the certificate presented to the server" if role == "client" else "served"
    g = parser.add_argument_group("TLS")
    g.add_argument(
        "--tls-cert",
        default=env.get("SPECSERVE_TLS_CERT"),
        metavar="PEM",
        help=f"certificate chain ({own}); with --tls-key",
    )
    g.add_argument(
        "--tls-key",
        default=env.get("SPECSERVE_TLS_KEY"),
        metavar="PEM",
        help="private key of --tls-cert",
    )
    g.add_argument("--tls-ca", default=env.get("SPECSERVE_TLS_CA"), metavar="PEM", help=ca_help)
    if role != "replica":
        g.add_argument(
            "--tls-server-name",
            default=env.get("SPECSERVE_TLS_SERVER_NAME"),
            metavar="NAME",
            help="check the server certificates against this name instead of the host dialled",
        )


def _pair(args: argparse.Namespace) -> tuple[str | None, str | None]:
    cert, key = args.tls_cert or None, args.tls_key or None
    if bool(cert) != bool(key):
        raise InvalidArgument("--tls-cert needs --tls-key, and --tls-key needs --tls-cert")
    return cert, key


def server_tls(args: argparse.Namespace, *, check_clients: bool) -> ServerTls | None:
    """The server side of the TLS flags (None: plaintext). ``check_clients``: --tls-ca
    makes the server require client certificates (replicas)."""
    cert, key = _pair(args)
    if cert is None or key is None:
        if args.tls_ca and check_clients:
            raise InvalidArgument("--tls-ca on a replica needs --tls-cert and --tls-key")
        return None
    for path, flag in ((cert, "--tls-cert"), (key, "--tls-key"), (args.tls_ca, "--tls-ca")):
        if path:
            read_pem(path, flag)  # a missing file is a flag error now, not a failed bind later
    ca = args.tls_ca or None
    return ServerTls(cert, key, ca if check_clients else None)


def client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The client side of the TLS flags: TLS when --tls-ca is given (None: plaintext)."""
    cert, key = _pair(args)
    if not args.tls_ca:
        return None
    for path, flag in ((args.tls_ca, "--tls-ca"), (cert, "--tls-cert"), (key, "--tls-key")):
        if path:
            read_pem(path, flag)
    return ClientTls(args.tls_ca, cert, key, getattr(args, "tls_server_name", None) or None)


def warn_if_exposed(host: str, tls: ServerTls | None, what: str) -> None:
    """A WARNING when a server listens beyond loopback without TLS."""
    if tls is None and host not in LOOPBACK_HOSTS:
        log.warning(
            "%s listens on %s without TLS: anyone who reaches the port can read and send "
            "its traffic (give --tls-cert and --tls-key)",
            what,
            host,
        )
