"""The KV snapshot chunk store: every Redis call of KV snapshots goes through :class:`ChunkStore`.

A chunk is one string, ``specserve:kv:<key hex>`` (:func:`~specserve.orchestrator.
keys.kv_key`), holding a serialized ``specserve.v1.KvChunk``. Chunks are
content-addressed — the same token prefix under the same model has the same key,
whichever session wrote it — so two writers of one key write the same bytes and
need no script or version: every write is one ``SET ... PX``. Writing, finding
(:meth:`ChunkStore.touch`) and reading (``GETEX ... PX``) a chunk all restart its
TTL, so a prefix in use stays while the rest expires. Chunks are never deleted
when a session ends: another session may share them.

Each method is one pipelined round trip. Redis failing raises
:class:`~specserve.serving.errors.Unavailable`; callers treat that as "no
snapshot" and never fail a request on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from specserve.orchestrator.store import keys
from specserve.serving.errors import Unavailable


class ChunkStore:
    """KV snapshot chunks in Redis (or the embedded store), each with a TTL."""

    def __init__(
        self, redis: Any, ttl_s: float = keys.KV_TTL_S, *, where: str = "Redis", owned: bool = False
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("every Redis key needs a TTL > 0 seconds")
        self.redis = redis
        self.ttl_ms = int(ttl_s * 1000)
        self.where = where
        self.owned = owned  # close the client with the store (not when it is the session store's)

    async def close(self) -> None:
        if self.owned:
            await self.redis.aclose()

    async def touch(self, chunk_keys: Sequence[bytes]) -> list[bool]:
        """Which chunks are stored; restarts the TTL of those that are."""
        if not chunk_keys:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for k in chunk_keys:
            pipe.pexpire(keys.kv_key(k), self.ttl_ms)
        return [bool(r) for r in await self._call(pipe.execute())]

    async def put(self, chunks: Sequence[tuple[bytes, bytes]]) -> None:
        """Store ``(key, serialized KvChunk)`` pairs, each with the TTL."""
        if not chunks:
            return
        pipe = self.redis.pipeline(transaction=False)
        for k, value in chunks:
            pipe.set(keys.kv_key(k), value, px=self.ttl_ms)
        await self._call(pipe.execute())

    async def get(self, chunk_keys: Sequence[bytes]) -> list[bytes | None]:
        """The stored chunks (None where absent); restarts the TTL of those found."""
        if not chunk_keys:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for k in chunk_keys:
            pipe.getex(keys.kv_key(k), px=self.ttl_ms)
        return list(await self._call(pipe.execute()))

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except RedisError as e:
            raise Unavailable(f"the KV snapshot store ({self.where}) failed: {e}") from e
        except OSError as e:
            raise Unavailable(f"the KV snapshot store ({self.where}) is unreachable: {e}") from e
