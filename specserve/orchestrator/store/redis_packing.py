"""Redis commands packed by hiredis: the asyncio client's connections with a C packer.

redis-py's asyncio connections pack every command in Python: about 17 µs for a
round's commit of one session (an ``EVALSHA`` of 15 arguments), 0.55 ms a round at
32 sessions, on the orchestrator's event loop. Its synchronous client can hand this
to hiredis; the asyncio one cannot. :func:`use_hiredis_packing` gives a client's pool
connection classes that do (``hiredis.pack_command``: ~2 µs for the same command).
The replies are parsed by hiredis too: redis-py picks its hiredis parser by itself
whenever hiredis is installed, and the project depends on it.

The bytes are those redis-py would send: a command name that holds its subcommand
(``"SCRIPT LOAD"``) is split into two arguments, strings are UTF-8, numbers their
decimal text; hiredis refuses what redis-py refuses (booleans, None) with TypeError.
"""

from __future__ import annotations

from typing import Any

import hiredis
from redis.asyncio.connection import Connection, SSLConnection


def pack(args: tuple[Any, ...]) -> list[bytes]:
    """One command's bytes (RESP), as ``Connection.pack_command`` returns them."""
    head = args[0]
    if (" " if isinstance(head, str) else b" ") in head:
        args = (*head.split(), *args[1:])
    return [hiredis.pack_command(args)]


class PackedConnection(Connection):
    """A TCP connection whose commands hiredis packs."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return pack(args)


class PackedSSLConnection(SSLConnection):
    """A TLS connection whose commands hiredis packs."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return pack(args)


def use_hiredis_packing(client: Any) -> Any:
    """``client`` (a ``redis.asyncio.Redis`` that has made no connection yet) with its
    pool's TCP or TLS connections packing by hiredis; other kinds (a Unix socket) are
    left as they are. Returns the client."""
    pool = client.connection_pool
    if issubclass(pool.connection_class, SSLConnection):
        pool.connection_class = PackedSSLConnection
    elif pool.connection_class is Connection:
        pool.connection_class = PackedConnection
    return client
