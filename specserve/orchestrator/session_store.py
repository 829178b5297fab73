"""The session store: every Redis call of the orchestrator goes through :class:`SessionStore`.

A session is one hash (see :mod:`specserve.orchestrator.keys`): the record's
version ``v`` and the serialized ``SessionRecord`` ``r``. Every write is one Lua
script, so it is atomic and complete — a record is either the old one or the new
one, never half of each — and every write sets the expiry:

* :meth:`SessionStore.create` writes version 1 only if the key does not exist;
* :meth:`SessionStore.commit` writes version ``v + 1`` only if the stored version
  is still ``v`` (the version the writer read). Two orchestrator replicas that
  both computed round r of a session cannot both commit it: the second gets
  :class:`~specserve.orchestrator.errors.VersionConflict` (or a ``CONFLICT``
  status from :meth:`SessionStore.commit_many`). A commit also reports whether a
  cancel was requested, so the round loop learns it with no extra round trip;
* :meth:`SessionStore.delete` removes the record and its cancel flag, optionally
  only at a given version.

Every script is idempotent, so the client may retry a call whose reply was lost:
a retried create or commit that finds its own bytes already stored succeeds.
Redis being down raises :class:`~specserve.serving.errors.Unavailable`.

A replica that lost a session re-prefills from the committed tokens held here,
or, with ``--kv-snapshots``, first restores the KV chunks saved under
``specserve:kv:`` (:mod:`specserve.orchestrator.kv_store` reads and writes
those; the record only notes how far they reach).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from redis.exceptions import RedisError

from specserve.engine.errors import NotFound
from specserve.orchestrator import keys
from specserve.orchestrator.errors import RecordError, VersionConflict
from specserve.serving.errors import Unavailable
from specserve.v1 import session_pb2

SCHEMA_VERSION = 1

# A retried call (the reply was lost, the script ran) finds its own bytes: success.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'r') == ARGV[1] then return 1 end
  return 0
end
redis.call('HSET', KEYS[1], 'v', '1', 'r', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# -> {status, stored version}; status 0 ok, 1 missing, 2 conflict, 3 ok but cancel requested
_COMMIT = """
local v = redis.call('HGET', KEYS[1], 'v')
if not v then return {1, 0} end
if v ~= ARGV[1] then
  if v == ARGV[2] and redis.call('HGET', KEYS[1], 'r') == ARGV[3] then return {0, 0} end
  return {2, tonumber(v)}
end
redis.call('HSET', KEYS[1], 'v', ARGV[2], 'r', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if ARGV[5] == '1' then
  redis.call('DEL', KEYS[2])
  return {0, 0}
end
if redis.call('EXISTS', KEYS[2]) == 1 then return {3, 0} end
return {0, 0}
"""

# -> 1 deleted, 0 missing, -1 version differs (nothing deleted)
_DELETE = """
local v = redis.call('HGET', KEYS[1], 'v')
if not v then
  redis.call('DEL', KEYS[2])
  return 0
end
if ARGV[1] ~= '' and v ~= ARGV[1] then return -1 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""

_CANCEL = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[1])
return 1
"""


class CommitStatus(enum.Enum):
    OK = "ok"
    CANCEL_REQUESTED = "cancel_requested"  # written; CancelSession was called meanwhile
    MISSING = "missing"  # nothing written: the session was closed or expired
    CONFLICT = "conflict"  # nothing written: another writer got there first


_STATUS = {
    0: CommitStatus.OK,
    1: CommitStatus.MISSING,
    2: CommitStatus.CONFLICT,
    3: CommitStatus.CANCEL_REQUESTED,
}


@dataclass(frozen=True)
class StoreTtls:
    """Key lifetimes (see :mod:`specserve.orchestrator.keys`)."""

    session_s: float = keys.SESSION_TTL_S
    cancel_s: float = keys.CANCEL_TTL_S

    def __post_init__(self) -> None:
        if self.session_s <= 0 or self.cancel_s <= 0:
            raise ValueError("every Redis key needs a TTL > 0 seconds")


def now_ms() -> int:
    return int(time.time() * 1000)


class SessionStore:
    """Session records in Redis (or an embedded fakeredis), read and written atomically."""

    def __init__(self, redis: Any, ttls: StoreTtls | None = None, *, where: str = "Redis") -> None:
        self.redis = redis
        self.ttls = ttls or StoreTtls()
        self.where = where
        self._create = redis.register_script(_CREATE)
        self._commit = redis.register_script(_COMMIT)
        self._delete = redis.register_script(_DELETE)
        self._cancel = redis.register_script(_CANCEL)

    @property
    def _ttl_ms(self) -> int:
        return int(self.ttls.session_s * 1000)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> None:
        """Raise Unavailable unless the store answers."""
        await self._call(self.redis.ping())

    async def create(self, record: session_pb2.SessionRecord) -> session_pb2.SessionRecord:
        """Store a new session at version 1; VersionConflict if the id is taken."""
        rec = _stamped(record, 1)
        created = await self._call(
            self._create(keys=[keys.session_key(rec.session_id)], args=[_bytes(rec), self._ttl_ms])
        )
        if not created:
            raise VersionConflict(f"session {rec.session_id!r} already exists")
        return rec

    async def get(self, session_id: str) -> session_pb2.SessionRecord | None:
        """The stored record, or None."""
        raw = await self._call(self.redis.hget(keys.session_key(session_id), keys.FIELD_RECORD))
        return None if raw is None else parse(raw, session_id)

    async def commit(
        self, record: session_pb2.SessionRecord, *, final: bool = False
    ) -> tuple[session_pb2.SessionRecord, bool]:
        """Write ``record`` if the stored version is still ``record.version``.

        Returns the written record (version + 1) and whether a cancel was requested.
        ``final`` also removes the cancel flag. Raises VersionConflict when another
        writer got there first, NotFound when the record is gone (closed or expired).
        """
        [(status, written)] = await self.commit_many([record], final=final)
        if status is CommitStatus.CONFLICT:
            raise VersionConflict(
                f"session {record.session_id!r} changed since version {record.version} was read "
                "(another orchestrator replica wrote it)"
            )
        if status is CommitStatus.MISSING:
            raise NotFound(f"session {record.session_id!r} was closed or expired meanwhile")
        return written, status is CommitStatus.CANCEL_REQUESTED

    async def commit_many(
        self, records: Sequence[session_pb2.SessionRecord], *, final: bool = False
    ) -> list[tuple[CommitStatus, session_pb2.SessionRecord]]:
        """Commit several sessions in one round trip; each is atomic on its own.

        Each record's ``version`` is the version its writer read. Returns, per record,
        the status and the record as written (version + 1, meaningful if written).
        """
        if not records:
            return []
        pipe = self.redis.pipeline(transaction=False)
        written = []
        for record in records:
            rec = _stamped(record, record.version + 1)
            written.append(rec)
            sid = rec.session_id
            await self._commit(
                keys=[keys.session_key(sid), keys.cancel_key(sid)],
                args=[record.version, rec.version, _bytes(rec), self._ttl_ms, int(final)],
                client=pipe,
            )
        replies = await self._call(pipe.execute())
        return [(_STATUS[int(r[0])], rec) for r, rec in zip(replies, written, strict=True)]

    async def delete(self, session_id: str, *, version: int | None = None) -> bool:
        """Remove a session and its cancel flag; with ``version``, only at that version.

        Returns whether a record was deleted.
        """
        done = await self._call(
            self._delete(
                keys=[keys.session_key(session_id), keys.cancel_key(session_id)],
                args=["" if version is None else version],
            )
        )
        if int(done) < 0:
            raise VersionConflict(f"session {session_id!r} changed since version {version}")
        return int(done) == 1

    async def request_cancel(self, session_id: str) -> bool:
        """Flag a session for cancellation (seen at its next commit); False if it is unknown."""
        done = await self._call(
            self._cancel(
                keys=[keys.session_key(session_id), keys.cancel_key(session_id)],
                args=[int(self.ttls.cancel_s * 1000)],
            )
        )
        return bool(done)

    async def touch(self, session_id: str) -> bool:
        """Restart a session's TTL; False if it is unknown."""
        return bool(
            await self._call(self.redis.pexpire(keys.session_key(session_id), self._ttl_ms))
        )

    async def ttl_s(self, key: str) -> float:
        """Seconds until ``key`` expires: -1 = no expiry, -2 = no such key (for tests)."""
        ms = int(await self._call(self.redis.pttl(key)))
        return ms / 1000 if ms >= 0 else float(ms)

    async def keys(self) -> list[str]:
        """Every specserve key (SCAN, for tests and debugging)."""
        found = []
        async for key in self.redis.scan_iter(match=keys.PREFIX + "*", count=500):
            found.append(key.decode() if isinstance(key, bytes) else str(key))
        return sorted(found)

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except RedisError as e:
            raise Unavailable(f"the session store ({self.where}) failed: {e}") from e
        except OSError as e:
            raise Unavailable(f"the session store ({self.where}) is unreachable: {e}") from e


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
