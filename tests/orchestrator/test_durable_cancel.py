"""A cancel is never lost: CancelSession's mark in the store, against fakeredis and a real Redis.

The mark (the session hash's ``c``) is written whoever owns the session and whether
or not its lease is live; from then on no final write other than CANCELLED — an
owner's IDLE end, a dying owner's last write, a rollback, a new turn — is written.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from specserve.orchestrator.errors import SessionCancelled
from specserve.orchestrator.store import keys, records
from specserve.orchestrator.store.session_store import CommitStatus, StoreTtls
from specserve.orchestrator.types import SessionState
from specserve.v1 import generate_pb2, session_pb2
from tests.orchestrator.conftest import StoreFactory

ACTIVE = generate_pb2.SESSION_STATE_ACTIVE
CANCELLED = generate_pb2.SESSION_STATE_CANCELLED


def active(sid: str) -> session_pb2.SessionRecord:
    return session_pb2.SessionRecord(
        session_id=sid, state=ACTIVE, tokens=[1, 2], turn_starts=[0], keep=True
    )


def test_a_cancel_from_another_store_survives_the_owners_last_writes(
    make_store: StoreFactory,
) -> None:
    """Store ``b`` (another orchestrator, no lease) cancels ``a``'s session: ``a``'s next
    round is written and told; its IDLE end, a rollback and a new turn are refused and
    change nothing; its CANCELLED end is written, and the mark stays."""

    async def body() -> None:
        a, b = make_store(), make_store()
        sid = uuid.uuid4().hex
        rec = await a.create(active(sid))
        assert await a.leased(sid)
        assert await b.load(sid) == (rec, False)
        assert await b.request_cancel(sid)
        _, cancelled = await b.load(sid)
        assert cancelled
        nxt = records.copy(rec)
        nxt.tokens.append(3)
        [(status, written)] = await a.commit_many([nxt], after=[rec])
        assert status is CommitStatus.CANCEL_REQUESTED  # the round is kept, the owner told
        idle = records.ended(written, SessionState.IDLE, warm=True)
        with pytest.raises(SessionCancelled, match="cancelled with CancelSession"):
            await a.commit(idle, final=True, after=written)
        with pytest.raises(SessionCancelled):  # a rollback writes the whole record
            await a.commit(idle, final=True)
        stored = await b.get(sid)
        assert stored is not None
        assert (stored.version, stored.state) == (written.version, ACTIVE)
        assert list(stored.tokens) == [1, 2, 3]
        ended, _ = await a.commit(
            records.ended(written, SessionState.CANCELLED, warm=False), final=True, after=written
        )
        got, cancelled = await b.load(sid)
        assert got is not None and got.state == CANCELLED and cancelled
        assert not await b.leased(sid)
        turn = records.copy(ended)
        turn.state = ACTIVE
        turn.tokens.append(4)
        with pytest.raises(SessionCancelled):  # a new turn, on any store
            await b.commit(turn, final=True)
        assert await b.delete(sid)
        assert await b.load(sid) == (None, False)
        await a.close()
        await b.close()

    asyncio.run(body())


def test_the_mark_outlives_the_cancel_flag(make_store: StoreFactory) -> None:
    """The cancel flag expires (``cancel_s``); the mark lives as long as the record, so an
    owner that writes its IDLE end long after still cannot."""

    async def body() -> None:
        store = make_store(StoreTtls(cancel_s=0.05))
        sid = uuid.uuid4().hex
        rec = await store.create(active(sid))
        assert await store.request_cancel(sid)
        await asyncio.sleep(0.2)
        assert await store.ttl_s(keys.cancel_key(sid)) == -2  # the flag is gone
        assert await store.ttl_s(keys.session_key(sid)) > 0  # the mark has the record's TTL
        with pytest.raises(SessionCancelled):
            await store.commit(records.ended(rec, SessionState.IDLE, warm=True), final=True)
        [(status, _)] = await store.commit_many([rec])
        assert status is CommitStatus.CANCEL_REQUESTED
        await store.delete(sid)
        await store.close()

    asyncio.run(body())


def test_a_session_never_cancelled_ends_idle(make_store: StoreFactory) -> None:
    """Without the mark a final IDLE write is written, and the next turn too (the guard
    refuses nothing else)."""

    async def body() -> None:
        store = make_store()
        sid = uuid.uuid4().hex
        rec = await store.create(active(sid))
        idle, _ = await store.commit(records.ended(rec, SessionState.IDLE, warm=True), final=True)
        assert await store.load(sid) == (idle, False)
        turn = records.copy(idle)
        turn.state = ACTIVE
        await store.commit(turn, final=True)
        assert not await store.request_cancel(uuid.uuid4().hex)  # unknown: nothing marked
        await store.delete(sid)
        await store.close()

    asyncio.run(body())


def test_get_session_reports_a_cancelled_session_whose_owner_died_as_cancelled() -> None:
    rec = active("s")
    assert records.summary(rec, leased=False).state is SessionState.IDLE
    assert records.summary(rec, leased=False, cancelled=True).state is SessionState.CANCELLED
    assert records.summary(rec, leased=True, cancelled=True).state is SessionState.ACTIVE
    idle = records.ended(rec, SessionState.IDLE, warm=True)
    assert records.summary(idle, leased=False, cancelled=True).state is SessionState.CANCELLED
