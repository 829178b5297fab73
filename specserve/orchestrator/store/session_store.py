"""The session store: every Redis call of the orchestrator goes through :class:`SessionStore`.

A session is one hash (see :mod:`specserve.orchestrator.store.keys`): the record's
version ``v``, the serialized ``SessionRecord`` ``r`` as written when its turn
began, and since record schema 2 the tokens ``t`` and the latest
``SessionDelta`` ``d`` its rounds wrote (:mod:`specserve.orchestrator.store.record_deltas`).
Every write is one Lua script (:mod:`specserve.orchestrator.store.store_scripts`), so
it is atomic and complete — a record is either the old one or the new one, never
half of each — and every write sets the expiry:

* :meth:`SessionStore.create` writes version 1 only if the key does not exist;
* :meth:`SessionStore.commit` writes version ``v + 1`` only if the stored version
  is still ``v`` (the version the writer read). Two orchestrator replicas that
  both computed round r of a session cannot both commit it: the second gets
  :class:`~specserve.orchestrator.errors.VersionConflict` (or a ``CONFLICT``
  status from :meth:`SessionStore.commit_many`). A commit also reports whether a
  cancel was requested, so the round loop learns it with no extra round trip.
  Given the record it last wrote (``after=``), a commit writes only the delta —
  the new tokens and the few fields a round changes — never the prompt, the stop
  strings or the sampling parameters again;
* :meth:`SessionStore.delete` removes the record, its cancel flag and its lease,
  optionally only at a given version;
* :meth:`SessionStore.request_cancel` marks the session cancelled in its hash (and
  sets the cancel flag the running orchestrator's next commit sees). The mark is
  durable: from then on a final commit whose record is not CANCELLED — the owner's
  IDLE end, a dying owner's last write, a new turn, a rollback — writes nothing
  and raises :class:`~specserve.orchestrator.errors.SessionCancelled`, whoever
  holds the lease; :meth:`SessionStore.load` reads the mark with the record.

A write that leaves a record ACTIVE takes this store's lease on it (``owner``,
``StoreTtls.lease_s``); :meth:`SessionStore.renew` keeps it while the session
generates; any other write drops it. :meth:`SessionStore.leased` tells whether
an ACTIVE record's orchestrator is alive.

Every script is idempotent, so a call whose reply was lost may be sent again: a
retried create or commit that finds its own bytes already stored succeeds. Every
call is retried on transient errors for ``retry_s`` seconds
(:mod:`specserve.orchestrator.store.store_retry`): a Redis restart inside that window
only pauses the streams. Past it, or on any other error,
:class:`~specserve.serving.errors.Unavailable` is raised.

A replica that lost a session re-prefills from the committed tokens held here,
or, with ``--kv-snapshots``, first restores the KV chunks saved under
``specserve:kv:`` (:mod:`specserve.orchestrator.snapshots.kv_store` reads and writes
those; the record only notes how far they reach).
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import DecodeError
from redis.exceptions import NoScriptError

from specserve.engine.errors import NotFound
from specserve.orchestrator.errors import RecordError, SessionCancelled, VersionConflict
from specserve.orchestrator.store import keys, store_scripts
from specserve.orchestrator.store.record_deltas import assemble, delta_of
from specserve.orchestrator.store.store_retry import DEFAULT_WINDOW_S, RetryWindow
from specserve.v1 import generate_pb2, session_pb2

# 2: a record is stored as deltas (``r`` + ``t`` + ``d``); 1 (``r`` alone) is still read.
SCHEMA_VERSION = 2
_ACTIVE = generate_pb2.SESSION_STATE_ACTIVE
_CANCELLED = generate_pb2.SESSION_STATE_CANCELLED

T = TypeVar("T")


class CommitStatus(enum.Enum):
    OK = "ok"
    CANCEL_REQUESTED = "cancel_requested"  # written; CancelSession was called meanwhile
    MISSING = "missing"  # nothing written: the session was closed or expired
    CONFLICT = "conflict"  # nothing written: another writer got there first
    CANCELLED = "cancelled"  # nothing written: a final write of a cancelled session not CANCELLED


_STATUS = {
    0: CommitStatus.OK,
    1: CommitStatus.MISSING,
    2: CommitStatus.CONFLICT,
    3: CommitStatus.CANCEL_REQUESTED,
    4: CommitStatus.CANCELLED,
}


@dataclass(frozen=True)
class StoreTtls:
    """Key lifetimes (see :mod:`specserve.orchestrator.store.keys`)."""

    session_s: float = keys.SESSION_TTL_S
    cancel_s: float = keys.CANCEL_TTL_S
    lease_s: float = keys.LEASE_S

    def __post_init__(self) -> None:
        if self.session_s <= 0 or self.cancel_s <= 0 or self.lease_s <= 0:
            raise ValueError("every Redis key needs a TTL > 0 seconds")


def now_ms() -> int:
    return int(time.time() * 1000)


class SessionStore:
    """Session records in Redis (or an embedded fakeredis), read and written atomically.

    ``owner`` names this orchestrator in the leases it takes (default: a fresh id).
    """

    def __init__(
        self,
        redis: Any,
        ttls: StoreTtls | None = None,
        *,
        where: str = "Redis",
        retry_s: float = DEFAULT_WINDOW_S,
        owner: str | None = None,
    ) -> None:
        self.redis = redis
        self.ttls = ttls or StoreTtls()
        self.where = where
        self.owner = owner or uuid.uuid4().hex
        self.retry = RetryWindow(f"the session store ({where})", retry_s)
        self._create = redis.register_script(store_scripts.CREATE)
        # Pipelined per round (commits) and per lease period (renewals): bare EVALSHAs.
        self._commit_script = store_scripts.PipelinedScript(redis, store_scripts.COMMIT)
        self._renew_script = store_scripts.PipelinedScript(redis, store_scripts.RENEW)
        self._commit = self._commit_script
        self._renew = self._renew_script
        self._delete = redis.register_script(store_scripts.DELETE)
        self._cancel = redis.register_script(store_scripts.CANCEL)

    @property
    def _ttl_ms(self) -> int:
        return int(self.ttls.session_s * 1000)

    @property
    def _lease_ms(self) -> int:
        return int(self.ttls.lease_s * 1000)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> None:
        """Raise Unavailable unless the store answers now (one attempt, no retries)."""
        await self.retry.call(self.redis.ping, retry=False)

    async def create(self, record: session_pb2.SessionRecord) -> session_pb2.SessionRecord:
        """Store a new session at version 1; VersionConflict if the id is taken."""
        rec = _stamped(record, 1)
        sid = rec.session_id
        created = await self._call(
            lambda: self._create(
                keys=[keys.session_key(sid), keys.lease_key(sid)],
                args=[_bytes(rec), self._ttl_ms, self._lease_owner(rec), self._lease_ms],
            )
        )
        if not created:
            raise VersionConflict(f"session {sid!r} already exists")
        return rec

    async def get(self, session_id: str) -> session_pb2.SessionRecord | None:
        """The stored record, or None."""
        record, _ = await self.load(session_id)
        return record

    async def load(self, session_id: str) -> tuple[session_pb2.SessionRecord | None, bool]:
        """The stored record (or None) and whether CancelSession marked it cancelled,
        in one read."""
        r, t, d, c = await self._call(
            lambda: self.redis.hmget(
                keys.session_key(session_id),
                [keys.FIELD_RECORD, keys.FIELD_TOKENS, keys.FIELD_DELTA, keys.FIELD_CANCELLED],
            )
        )
        if r is None:
            return None, False
        return assemble(parse(r, session_id), t, d), c is not None

    async def leased(self, session_id: str) -> bool:
        """Whether some orchestrator holds the session's lease (is generating it, alive)."""
        return bool(await self._call(lambda: self.redis.exists(keys.lease_key(session_id))))

    async def renew(self, session_ids: Sequence[str]) -> int:
        """Extend this store's leases on sessions (one attempt); returns how many it held."""
        if not session_ids:
            return 0

        async def fill(pipe: Any) -> None:
            for sid in session_ids:
                await self._renew(
                    keys=[keys.lease_key(sid)], args=[self.owner, self._lease_ms], client=pipe
                )

        replies = await self.retry.call(
            lambda: self._pipelined(self._renew_script, fill), retry=False
        )
        return sum(int(r) for r in replies)

    async def commit(
        self,
        record: session_pb2.SessionRecord,
        *,
        final: bool = False,
        after: session_pb2.SessionRecord | None = None,
    ) -> tuple[session_pb2.SessionRecord, bool]:
        """Write ``record`` if the stored version is still ``record.version``.

        Returns the written record (version + 1) and whether a cancel was requested.
        ``final`` also removes the cancel flag. ``after``: the record as this store
        last wrote it, when ``record`` only appends tokens and changes delta fields
        (then only those are written). Raises VersionConflict when another writer got
        there first, NotFound when the record is gone (closed or expired), and
        SessionCancelled (nothing written) when ``final`` writes a state other than
        CANCELLED on a session marked cancelled.
        """
        [(status, written)] = await self.commit_many([record], final=final, after=[after])
        if status is CommitStatus.CONFLICT:
            raise VersionConflict(
                f"session {record.session_id!r} changed since version {record.version} was read "
                "(another orchestrator replica wrote it)"
            )
        if status is CommitStatus.MISSING:
            raise NotFound(f"session {record.session_id!r} was closed or expired meanwhile")
        if status is CommitStatus.CANCELLED:
            raise SessionCancelled(cancelled_message(record.session_id))
        return written, status is CommitStatus.CANCEL_REQUESTED

    async def commit_many(
        self,
        records: Sequence[session_pb2.SessionRecord],
        *,
        final: bool = False,
        after: Sequence[session_pb2.SessionRecord | None] | None = None,
    ) -> list[tuple[CommitStatus, session_pb2.SessionRecord]]:
        """Commit several sessions in one round trip; each is atomic on its own.

        Each record's ``version`` is the version its writer read; ``after[i]``, if
        given, is the record as last written, and record ``i`` is written as a delta
        from it (see :meth:`commit`). Returns, per record, the status and the record as
        written (version + 1, meaningful if written).
        """
        if not records:
            return []
        bases = list(after) if after is not None else [None] * len(records)
        written = [_stamped(r, r.version + 1) for r in records]
        calls = []
        for read, rec, base in zip(records, written, bases, strict=True):
            sid = rec.session_id
            if base is None:
                field, payload, appended = keys.FIELD_RECORD, _bytes(rec), b""
            else:
                delta, appended = delta_of(base, rec)
                field, payload = keys.FIELD_DELTA, delta.SerializeToString(deterministic=True)
            calls.append(
                (
                    [keys.session_key(sid), keys.cancel_key(sid), keys.lease_key(sid)],
                    [
                        read.version,
                        rec.version,
                        field,
                        payload,
                        appended,
                        self._ttl_ms,
                        int(final),
                        self._lease_owner(rec),
                        self._lease_ms,
                        int(rec.state == _CANCELLED),
                    ],
                )
            )

        async def fill(pipe: Any) -> None:
            for call_keys, args in calls:
                await self._commit(keys=call_keys, args=args, client=pipe)

        replies = await self._call(lambda: self._pipelined(self._commit_script, fill))
        return [(_STATUS[int(r[0])], rec) for r, rec in zip(replies, written, strict=True)]

    async def delete(self, session_id: str, *, version: int | None = None) -> bool:
        """Remove a session, its cancel flag and its lease; with ``version``, only at that
        version. Returns whether a record was deleted.
        """
        done = await self._call(
            lambda: self._delete(
                keys=[
                    keys.session_key(session_id),
                    keys.cancel_key(session_id),
                    keys.lease_key(session_id),
                ],
                args=["" if version is None else version],
            )
        )
        if int(done) < 0:
            raise VersionConflict(f"session {session_id!r} changed since version {version}")
        return int(done) == 1

    async def request_cancel(self, session_id: str) -> bool:
        """Mark a session cancelled, for good, and flag it for whichever orchestrator runs
        it (seen at its next commit); False if it is unknown. Atomic, and the same
        whether or not this orchestrator owns the session or its lease is live."""
        done = await self._call(
            lambda: self._cancel(
                keys=[keys.session_key(session_id), keys.cancel_key(session_id)],
                args=[int(self.ttls.cancel_s * 1000)],
            )
        )
        return bool(done)

    async def touch(self, session_id: str) -> bool:
        """Restart a session's TTL; False if it is unknown."""
        return bool(
            await self._call(lambda: self.redis.pexpire(keys.session_key(session_id), self._ttl_ms))
        )

    async def ttl_s(self, key: str) -> float:
        """Seconds until ``key`` expires: -1 = no expiry, -2 = no such key (for tests)."""
        ms = int(await self._call(lambda: self.redis.pttl(key)))
        return ms / 1000 if ms >= 0 else float(ms)

    async def keys(self) -> list[str]:
        """Every specserve key (SCAN, for tests and debugging)."""

        async def attempt() -> list[str]:
            found = []
            async for key in self.redis.scan_iter(match=keys.PREFIX + "*", count=500):
                found.append(key.decode() if isinstance(key, bytes) else str(key))
            return sorted(found)

        return await self._call(attempt)

    def _lease_owner(self, record: session_pb2.SessionRecord) -> str:
        """Who the write makes the session's lease holder: this store if ACTIVE, else none."""
        return self.owner if record.state == _ACTIVE else ""

    async def _call(self, attempt: Callable[[], Awaitable[T]]) -> T:
        return await self.retry.call(attempt)

    async def _pipelined(
        self, script: store_scripts.PipelinedScript, fill: Callable[[Any], Awaitable[None]]
    ) -> list[Any]:
        """One pipeline that ``fill`` fills with calls of ``script``: its replies. Sent
        again once if Redis had lost the script (``NOSCRIPT``: none of its calls ran)."""
        await script.load()
        try:
            return await self._send(fill)
        except NoScriptError:
            script.forget()
            await script.load()
            return await self._send(fill)

    async def _send(self, fill: Callable[[Any], Awaitable[None]]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        await fill(pipe)
        return list(await pipe.execute())


def cancelled_message(session_id: str) -> str:
    """The sentence of :class:`SessionCancelled` for ``session_id``."""
    return (
        f"session {session_id!r} was cancelled with CancelSession and cannot be continued; "
        "read it with GetSession or delete it with CloseSession"
    )


def parse(raw: bytes, session_id: str) -> session_pb2.SessionRecord:
    """Bytes of a stored record -> SessionRecord; RecordError if unreadable or too new."""
    record = session_pb2.SessionRecord()
    try:
        record.ParseFromString(raw)
    except DecodeError as e:
        raise RecordError(f"the stored record of session {session_id!r} is corrupt: {e}") from e
    if record.schema_version > SCHEMA_VERSION:
        raise RecordError(
            f"session {session_id!r} was written with record schema {record.schema_version}; "
            f"this orchestrator reads up to {SCHEMA_VERSION} (upgrade it)"
        )
    return record


def _stamped(record: session_pb2.SessionRecord, version: int) -> session_pb2.SessionRecord:
    rec = session_pb2.SessionRecord()
    rec.CopyFrom(record)
    rec.schema_version = SCHEMA_VERSION
    rec.version = version
    rec.updated_unix_ms = now_ms()
    if not rec.created_unix_ms:
        rec.created_unix_ms = rec.updated_unix_ms
    return rec


def _bytes(record: session_pb2.SessionRecord) -> bytes:
    return record.SerializeToString(deterministic=True)
