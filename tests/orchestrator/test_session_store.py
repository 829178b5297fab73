"""SessionStore against fakeredis and a real Redis: atomic commits, conflicts, TTLs, cleanup."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from specserve.engine.errors import NotFound
from specserve.orchestrator.errors import RecordError, VersionConflict
from specserve.orchestrator.store import keys
from specserve.orchestrator.store.record_deltas import delta_of
from specserve.orchestrator.store.session_store import (
    SCHEMA_VERSION,
    CommitStatus,
    SessionStore,
    StoreTtls,
)
from specserve.serving.errors import Unavailable
from specserve.v1 import generate_pb2, session_pb2
from tests.orchestrator.conftest import StoreFactory


def record(sid: str, tokens: list[int]) -> session_pb2.SessionRecord:
    return session_pb2.SessionRecord(
        session_id=sid, state=generate_pb2.SESSION_STATE_ACTIVE, tokens=tokens, turn_starts=[0]
    )


def next_record(rec: session_pb2.SessionRecord, token: int) -> session_pb2.SessionRecord:
    """A copy of ``rec`` with ``token`` appended: the next round's record."""
    nxt = session_pb2.SessionRecord()
    nxt.CopyFrom(rec)
    nxt.tokens.append(token)
    return nxt


def sid() -> str:
    return uuid.uuid4().hex


def test_create_get_commit_delete(make_store: StoreFactory) -> None:
    async def body() -> None:
        store = make_store()
        s = sid()
        assert await store.get(s) is None
        rec = await store.create(record(s, [1, 2, 3]))
        assert (rec.version, rec.schema_version) == (1, SCHEMA_VERSION)
        assert rec.created_unix_ms > 0
        got = await store.get(s)
        assert got == rec
        rec.tokens.extend([4, 5])
        written, cancel = await store.commit(rec)
        assert (written.version, cancel) == (2, False)
        got = await store.get(s)
        assert got is not None and list(got.tokens) == [1, 2, 3, 4, 5] and got.version == 2
        assert await store.delete(s, version=2)
        assert await store.get(s) is None
        assert not await store.delete(s)
        await store.close()

    asyncio.run(body())


def test_create_twice_conflicts(make_store: StoreFactory) -> None:
    async def body() -> None:
        store = make_store()
        s = sid()
        await store.create(record(s, [1]))
        with pytest.raises(VersionConflict, match="already exists"):
            await store.create(record(s, [2]))
        got = await store.get(s)
        assert got is not None and list(got.tokens) == [1]
        await store.delete(s)
        await store.close()

    asyncio.run(body())


def test_two_writers_one_round_one_wins(make_store: StoreFactory) -> None:
    """Two replicas both computed round 1 from version 1: exactly one commit lands."""

    async def body() -> None:
        a, b = make_store(), make_store()  # two clients, like two orchestrator replicas
        s = sid()
        base = await a.create(record(s, [1, 2]))
        mine, theirs = session_pb2.SessionRecord(), session_pb2.SessionRecord()
        mine.CopyFrom(base)
        theirs.CopyFrom(base)
        mine.tokens.extend([10, 11])
        theirs.tokens.extend([20])
        results = await asyncio.gather(a.commit(mine), b.commit(theirs), return_exceptions=True)
        wins = [r for r in results if not isinstance(r, BaseException)]
        losses = [r for r in results if isinstance(r, BaseException)]
        assert len(wins) == 1 and len(losses) == 1
        assert isinstance(losses[0], VersionConflict)
        stored = await a.get(s)
        assert stored is not None and stored.version == 2
        assert list(stored.tokens) in ([1, 2, 10, 11], [1, 2, 20])
        assert stored == wins[0][0]
        # A stale writer is refused again later, and nothing it sent was applied.
        with pytest.raises(VersionConflict):
            await b.commit(theirs)
        await a.delete(s)
        await a.close()
        await b.close()

    asyncio.run(body())


def test_commit_many_reports_each_session(make_store: StoreFactory) -> None:
    async def body() -> None:
        store = make_store()
        s1, s2, s3 = sid(), sid(), sid()
        r1 = await store.create(record(s1, [1]))
        r2 = await store.create(record(s2, [2]))
        stale = session_pb2.SessionRecord()
        stale.CopyFrom(r2)
        stale.version = 7  # not what is stored
        assert await store.request_cancel(s1)
        out = await store.commit_many([r1, stale, record(s3, [3])])
        assert [status for status, _ in out] == [
            CommitStatus.CANCEL_REQUESTED,
            CommitStatus.CONFLICT,
            CommitStatus.MISSING,
        ]
        assert await store.get(s3) is None  # a missing record is not created by a commit
        got = await store.get(s1)
        assert got is not None and got.version == 2
        # The final write clears the cancel flag (CANCELLED: no other end is written now).
        got.state = generate_pb2.SESSION_STATE_CANCELLED
        await store.commit(got, final=True)
        assert keys.cancel_key(s1) not in await store.keys()
        await store.delete(s1)
        await store.delete(s2)
        await store.close()

    asyncio.run(body())


def test_commit_of_a_closed_session_is_not_found(make_store: StoreFactory) -> None:
    async def body() -> None:
        store = make_store()
        s = sid()
        rec = await store.create(record(s, [1]))
        await store.delete(s)
        with pytest.raises(NotFound):
            await store.commit(rec)
        assert await store.get(s) is None
        await store.close()

    asyncio.run(body())


def test_every_key_has_a_ttl(make_store: StoreFactory) -> None:
    async def body() -> None:
        store = make_store(StoreTtls(session_s=50, cancel_s=5))
        s = sid()
        rec = await store.create(record(s, [1]))
        assert await store.request_cancel(s)
        mine = [k for k in await store.keys() if s in k]
        # An ACTIVE record comes with its writer's lease.
        assert sorted(mine) == sorted([keys.session_key(s), keys.cancel_key(s), keys.lease_key(s)])
        for key in mine:
            ttl = await store.ttl_s(key)
            assert 0 < ttl <= 50, (key, ttl)
        assert await store.ttl_s(keys.cancel_key(s)) <= 5
        assert await store.ttl_s(keys.lease_key(s)) <= keys.LEASE_S
        # A commit restarts the session's TTL.
        await store.redis.pexpire(keys.session_key(s), 1000)
        await store.commit(rec)
        assert await store.ttl_s(keys.session_key(s)) > 40
        assert not await store.request_cancel(sid())  # unknown sessions get no flag
        await store.delete(s)
        assert not [k for k in await store.keys() if s in k]
        await store.close()

    asyncio.run(body())


def test_expired_session_is_gone(make_store: StoreFactory) -> None:
    async def body() -> None:
        store = make_store(StoreTtls(session_s=0.2, cancel_s=0.2))
        s = sid()
        await store.create(record(s, [1]))
        await asyncio.sleep(0.5)
        assert await store.get(s) is None
        await store.close()

    asyncio.run(body())


def test_newer_schema_is_refused(make_store: StoreFactory) -> None:
    async def body() -> None:
        store = make_store()
        s = sid()
        future = record(s, [1])
        future.schema_version = SCHEMA_VERSION + 1
        await store.redis.hset(
            keys.session_key(s), mapping={"v": "1", "r": future.SerializeToString()}
        )
        await store.redis.expire(keys.session_key(s), 60)
        with pytest.raises(RecordError, match="schema"):
            await store.get(s)
        await store.delete(s)
        await store.close()

    asyncio.run(body())


@pytest.mark.redis
def test_unreachable_redis_is_unavailable() -> None:
    from specserve.orchestrator.store.redis_settings import RedisSettings
    from tests.orchestrator.redis_server import free_port

    async def body() -> None:
        settings = RedisSettings.from_url(f"redis://127.0.0.1:{free_port()}", connect_timeout_s=0.5)
        store = SessionStore(settings.client(), where=settings.display, retry_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match=r"session store .* unreachable for 0\.3 s"):
            await store.get("x")
        assert time.monotonic() - t0 < 3  # retried for the window, not for ever
        await store.close()

    asyncio.run(body())


def test_a_retried_write_finds_its_own_bytes(make_store: StoreFactory) -> None:
    """The reply of a write was lost and the client sends it again: it must not conflict,
    and a retried delta must not append its tokens twice."""

    async def body() -> None:
        store = make_store()
        s = sid()
        rec = await store.create(record(s, [1]))
        nxt = next_record(rec, 2)
        [(status, written)] = await store.commit_many([nxt], after=[rec])
        assert status is CommitStatus.OK
        delta, appended = delta_of(rec, written)
        payload = delta.SerializeToString(deterministic=True)
        session_keys = [keys.session_key(s), keys.cancel_key(s), keys.lease_key(s)]

        def args(sent: bytes) -> list[object]:  # as commit_many sends them
            return [rec.version, written.version, "d", sent, appended, 60_000, 0, "me", 5000]

        again = await store._commit(keys=session_keys, args=args(payload))
        assert int(again[0]) == 0
        got = await store.get(s)
        assert got is not None and list(got.tokens) == [1, 2]  # not [1, 2, 2]
        other = await store._commit(keys=session_keys, args=args(payload + b"x"))
        assert int(other[0]) == 2  # different bytes: a real conflict
        await store.delete(s)
        await store.close()

    asyncio.run(body())


def test_rounds_are_deltas_over_a_record_written_once(make_store: StoreFactory) -> None:
    """A schema-1 record (the whole record in ``r``) is read; rounds committed over it append
    tokens to ``t`` and leave ``r`` alone; a whole write folds them back into ``r``."""

    async def body() -> None:
        store = make_store()
        s = sid()
        old = record(s, [1, 2])
        old.schema_version, old.version = 1, 1
        old.stop.append("x" * 1000)
        r = old.SerializeToString()
        await store.redis.hset(keys.session_key(s), mapping={"v": "1", "r": r})
        await store.redis.pexpire(keys.session_key(s), 60_000)
        got = await store.get(s)
        assert got == old
        written = got
        for token in (3, 4):
            nxt = next_record(written, token)
            nxt.round_index += 1
            nxt.target.endpoint = f"t{token}"
            [(status, written)] = await store.commit_many([nxt], after=[written])
            assert status is CommitStatus.OK
        assert await store.redis.hget(keys.session_key(s), "r") == r  # written once
        got = await store.get(s)
        assert got is not None and list(got.tokens) == [1, 2, 3, 4]
        assert (got.version, got.round_index, got.target.endpoint) == (3, 2, "t4")
        assert list(got.stop) == ["x" * 1000]
        whole, _ = await store.commit(got)
        fields = await store.redis.hgetall(keys.session_key(s))
        assert set(fields) == {b"v", b"r"} and await store.get(s) == whole
        await store.redis.hset(keys.session_key(s), "t", b"\x01\x02\x03")  # not whole int32s
        with pytest.raises(RecordError, match="corrupt"):
            await store.get(s)
        await store.delete(s)
        await store.close()

    asyncio.run(body())


def test_a_commit_and_a_renewal_after_redis_lost_its_scripts_load_them_again(
    make_store: StoreFactory,
) -> None:
    """Pipelines carry bare EVALSHAs; a Redis that lost its scripts (a restart, SCRIPT
    FLUSH) answers NOSCRIPT, and the store loads them and sends the pipeline again."""

    async def body() -> None:
        store = make_store()
        s = sid()
        rec = await store.create(record(s, [1]))
        nxt = next_record(rec, 2)
        [(status, written)] = await store.commit_many([nxt], after=[rec])
        assert status is CommitStatus.OK
        await store.redis.script_flush()
        again = next_record(written, 3)
        [(status, _)] = await store.commit_many([again], after=[written])
        assert status is CommitStatus.OK
        got = await store.get(s)
        assert got is not None and list(got.tokens) == [1, 2, 3]  # written once
        await store.redis.script_flush()
        assert await store.renew([s]) == 1
        await store.delete(s)
        await store.close()

    asyncio.run(body())


def test_a_pipelined_commit_is_one_round_trip_without_script_exists(
    make_store: StoreFactory,
) -> None:
    """redis-py's registered scripts ask SCRIPT EXISTS before every pipeline that carries
    one: a round trip more per round. The store's commits do not (real Redis counts)."""

    async def body() -> None:
        store = make_store()
        if "fake" in type(store.redis).__module__:
            await store.close()
            pytest.skip("fakeredis keeps no command statistics")

        async def script_exists() -> int:
            stats = await store.redis.info("commandstats")
            return int(stats.get("cmdstat_script|exists", {}).get("calls", 0))

        s = sid()
        rec = await store.create(record(s, [1]))
        before = await script_exists()
        for token in (2, 3, 4):
            nxt = next_record(rec, token)
            [(status, written)] = await store.commit_many([nxt], after=[rec])
            assert status is CommitStatus.OK
            rec = written
        assert await store.renew([s]) == 1
        assert await script_exists() == before
        await store.delete(s)
        await store.close()

    asyncio.run(body())
