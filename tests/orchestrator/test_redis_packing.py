"""The store's Redis commands packed by hiredis: the bytes redis-py would send, on the
connections the store's clients make, and a real server that answers them."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio.connection import Connection, UnixDomainSocketConnection

from specserve.orchestrator.store import redis_packing
from specserve.orchestrator.store.redis_settings import RedisSettings

COMMANDS = [
    (
        "EVALSHA",
        "a" * 40,
        3,
        "specserve:session:{s}",
        "k:{s}",
        "l:{s}",
        4,
        5,
        "d",
        b"\x00\xff",
        b"",
        3600000,
        0,
        "o",
        15000,
    ),
    ("SCRIPT LOAD", "return 1"),  # a subcommand inside the name is split off
    (b"CONFIG GET", b"maxmemory"),
    ("SET", "clé", 1.5),  # UTF-8, a float's text
    ("PEXPIRE", b"k", -1),
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: str(a[0]))
def test_the_bytes_are_redis_pys(args: tuple[object, ...]) -> None:
    assert redis_packing.pack(args) == [b"".join(Connection().pack_command(*args))]


def test_what_redis_py_refuses_is_refused() -> None:
    for bad in (True, None):
        with pytest.raises(TypeError):
            redis_packing.pack(("SET", "k", bad))


def test_the_store_clients_connections_pack_by_hiredis() -> None:
    plain = RedisSettings(port=6379).client()
    assert plain.connection_pool.connection_class is redis_packing.PackedConnection
    tls = RedisSettings(port=6379, tls=True).client()
    assert tls.connection_pool.connection_class is redis_packing.PackedSSLConnection
    unix = RedisSettings(port=6379).client()
    unix.connection_pool.connection_class = UnixDomainSocketConnection
    redis_packing.use_hiredis_packing(unix)
    assert unix.connection_pool.connection_class is UnixDomainSocketConnection


@pytest.mark.redis
def test_a_real_server_answers_packed_commands_and_pipelines(redis_url: str) -> None:
    async def go() -> None:
        client = RedisSettings.from_url(redis_url).client()
        try:
            assert await client.set("specserve:test:packing", "é" * 3)
            assert await client.get("specserve:test:packing") == "é".encode() * 3
            script = client.register_script("return {ARGV[1], #ARGV}")
            pipe = client.pipeline(transaction=False)
            for i in range(3):
                await script(keys=[], args=[i, b"x"], client=pipe)
            assert await pipe.execute() == [[b"0", 2], [b"1", 2], [b"2", 2]]
            assert await client.delete("specserve:test:packing") == 1
        finally:
            await client.aclose()

    asyncio.run(go())
