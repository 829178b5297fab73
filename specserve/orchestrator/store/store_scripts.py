"""The session store's Lua scripts: each write of a session is one of them, atomic and whole.

Keys and hash fields are :mod:`specserve.orchestrator.store.keys`'. Every script is
idempotent, so a call whose reply was lost (Redis restarted, the connection
dropped) may be sent again: a retried create or commit that finds its own bytes
already stored succeeds and writes nothing twice — a round's tokens are never
appended twice.

Every write that leaves a record ACTIVE also sets the writer's lease (``owner``,
``lease_ms``); every other write drops the lease.

A session that CancelSession marked cancelled (the hash's ``c``) is never ended
other than CANCELLED: a final commit of any other state (IDLE from an owner that
finished or died, a new turn, a rollback) writes nothing and answers status 4,
whoever holds the lease; a round's commit is written and answers status 3 (cancel
requested), as with the cancel flag.
"""

from __future__ import annotations

import hashlib
from typing import Any

from redis.exceptions import NoScriptError

# KEYS session, lease; ARGV r, ttl_ms, owner ('' = no lease), lease_ms -> 1 created, 0 taken
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'v') == '1' and redis.call('HGET', KEYS[1], 'r') == ARGV[1] then
    return 1
  end
  return 0
end
redis.call('HSET', KEYS[1], 'v', '1', 'r', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if ARGV[3] ~= '' then redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4]) end
return 1
"""

# KEYS session, cancel, lease
# ARGV 1 version read, 2 version written, 3 'r' (the whole record) or 'd' (a delta),
#      4 the record or delta bytes, 5 tokens to append to 't' (delta only), 6 ttl_ms,
#      7 final ('1': remove the cancel flag), 8 lease owner ('' = drop the lease), 9 lease_ms,
#      10 '1' if the record written is CANCELLED
# -> {status, stored version}; status 0 ok, 1 missing, 2 conflict, 3 ok but cancel requested,
#    4 nothing written: the session is cancelled and this final write is not CANCELLED
COMMIT = """
local v = redis.call('HGET', KEYS[1], 'v')
if not v then return {1, 0} end
if v ~= ARGV[1] then
  if v == ARGV[2] and redis.call('HGET', KEYS[1], ARGV[3]) == ARGV[4] then return {0, 0} end
  return {2, tonumber(v)}
end
local cancelled = redis.call('HEXISTS', KEYS[1], 'c') == 1
if cancelled and ARGV[7] == '1' and ARGV[10] ~= '1' then return {4, tonumber(v)} end
if ARGV[3] == 'r' then
  redis.call('HDEL', KEYS[1], 't', 'd')
  redis.call('HSET', KEYS[1], 'v', ARGV[2], 'r', ARGV[4])
else
  redis.call('HSET', KEYS[1], 'v', ARGV[2], 'd', ARGV[4])
  if ARGV[5] ~= '' then
    redis.call('HSET', KEYS[1], 't', (redis.call('HGET', KEYS[1], 't') or '') .. ARGV[5])
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[6])
if ARGV[8] ~= '' then
  redis.call('SET', KEYS[3], ARGV[8], 'PX', ARGV[9])
else
  redis.call('DEL', KEYS[3])
end
if ARGV[7] == '1' then
  redis.call('DEL', KEYS[2])
  return {0, 0}
end
if cancelled or redis.call('EXISTS', KEYS[2]) == 1 then return {3, 0} end
return {0, 0}
"""

# KEYS session, cancel, lease; ARGV version ('' = any)
# -> 1 deleted, 0 missing, -1 version differs (nothing deleted)
DELETE = """
local v = redis.call('HGET', KEYS[1], 'v')
if not v then
  redis.call('DEL', KEYS[2], KEYS[3])
  return 0
end
if ARGV[1] ~= '' and v ~= ARGV[1] then return -1 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
"""

# KEYS session, cancel; ARGV cancel_ttl_ms -> 1 marked and flagged, 0 no such session
CANCEL = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'c', '1')
redis.call('SET', KEYS[2], '1', 'PX', ARGV[1])
return 1
"""

# KEYS lease; ARGV owner, lease_ms -> 1 renewed, 0 the lease is gone or someone else's
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


class PipelinedScript:
    """A script a pipeline carries as a bare ``EVALSHA``.

    redis-py's registered scripts make every pipeline that carries one ask Redis
    ``SCRIPT EXISTS`` first: one round trip more for each round's commit. This one is
    loaded once (:meth:`load`); a pipeline that finds it gone (a restarted Redis answers
    ``NOSCRIPT``, and then none of the pipeline's calls of it ran) loads it again and is
    sent again by its caller. Called without a pipeline it runs at once, loading itself
    if need be, like a registered script.
    """

    def __init__(self, redis: Any, source: str) -> None:
        self.redis = redis
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self.loaded = False

    async def load(self) -> None:
        """Have Redis hold the script (once; again after :meth:`forget`)."""
        if not self.loaded:
            self.sha = await self.redis.script_load(self.source)
            self.loaded = True

    def forget(self) -> None:
        """Redis answered ``NOSCRIPT``: load it again before the next use."""
        self.loaded = False

    async def __call__(self, *, keys: list[str], args: list[Any], client: Any = None) -> Any:
        """Buffer the call in the pipeline ``client``, or (None) run it now: its reply."""
        if client is not None:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        await self.load()
        try:
            return await self.redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.forget()
            await self.load()
            return await self.redis.evalsha(self.sha, len(keys), *keys, *args)
