"""ChunkStore against fakeredis and a real Redis: every chunk has a TTL, reads restart it."""

from __future__ import annotations

import asyncio
import os

import pytest

from specserve.orchestrator.snapshots.kv_store import ChunkStore
from specserve.orchestrator.store import keys
from specserve.serving.errors import Unavailable
from tests.orchestrator.conftest import StoreFactory


def test_put_touch_get_with_ttls(make_store: StoreFactory) -> None:
    async def body() -> None:
        sessions = make_store()
        store = ChunkStore(sessions.redis, ttl_s=30)
        a, b, absent = os.urandom(32), os.urandom(32), os.urandom(32)
        await store.put([(a, b"chunk a"), (b, b"chunk b")])
        assert {keys.kv_key(a), keys.kv_key(b)} <= set(await sessions.keys())
        assert await store.get([a, absent, b]) == [b"chunk a", None, b"chunk b"]
        assert await store.touch([absent, b]) == [False, True]
        assert await sessions.ttl_s(keys.kv_key(absent)) == -2  # touching never creates
        for k in (a, b):
            assert 0 < await sessions.ttl_s(keys.kv_key(k)) <= 30
        # reading and touching restart the TTL
        await sessions.redis.pexpire(keys.kv_key(a), 1000)
        await store.get([a])
        assert await sessions.ttl_s(keys.kv_key(a)) > 20
        await sessions.redis.pexpire(keys.kv_key(b), 1000)
        await store.touch([b])
        assert await sessions.ttl_s(keys.kv_key(b)) > 20
        assert await store.get([]) == [] and await store.touch([]) == []
        await sessions.redis.delete(keys.kv_key(a), keys.kv_key(b))
        await store.close()  # not owned: the session store's client stays open
        assert await sessions.get("nobody") is None
        await sessions.close()

    asyncio.run(body())


def test_an_unreachable_store_is_unavailable() -> None:
    from specserve.orchestrator.store.redis_settings import RedisSettings
    from tests.orchestrator.redis_server import free_port

    async def body() -> None:
        settings = RedisSettings(port=free_port(), retries=0, connect_timeout_s=0.5)
        store = ChunkStore(settings.client(), owned=True)
        with pytest.raises(Unavailable, match="KV snapshot store"):
            await store.touch([bytes(32)])
        await store.close()

    asyncio.run(body())


def test_chunks_need_a_ttl() -> None:
    with pytest.raises(ValueError, match="TTL"):
        ChunkStore(object(), ttl_s=0)
