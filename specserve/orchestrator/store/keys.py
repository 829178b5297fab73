"""Redis key names and lifetimes: every key the orchestrator writes, in one place.

==============================  =====================  ==========================================
key                             type                   lifetime
==============================  =====================  ==========================================
``specserve:session:{<id>}``    hash ``v``, ``r``,     ``SESSION_TTL_S`` from the last write; a
                                ``t``, ``d``, ``c``    running generation writes it every round
``specserve:cancel:{<id>}``     string (``1``)         ``CANCEL_TTL_S``; removed by the final write
``specserve:lease:{<id>}``      string: the owning     ``LEASE_S`` (``--session-lease-s``) from
                                orchestrator's id      its last renewal; only while ACTIVE
``specserve:kv:<chunk key>``    string: a serialized   ``KV_TTL_S`` (``--kv-snapshot-ttl-s``)
                                ``KvChunk``            from its last write or read
==============================  =====================  ==========================================

A session hash holds ``v``, the record's version as a decimal integer (what the
commit script compares), ``r``, the serialized ``specserve.v1.SessionRecord`` as
written when its turn began, and (record schema 2) ``t``, the tokens committed
since, little-endian int32, appended by each round, and ``d``, the latest
``specserve.v1.SessionDelta`` (state, round index, KV owners, usage). A round
writes its new tokens and the delta, never the prompt, the stop strings or the
sampling parameters again. ``c`` (``1``), set by CancelSession on a generating
session, marks it cancelled for good: it lives as long as the record, whoever
owns the lease and whether or not that one is alive, and the commit script lets
no write end the session other than CANCELLED (nor start a new turn). Keeping
the version beside the bytes lets a Lua script check it without parsing
protobuf. The ``{<id>}`` hash tag puts a session's keys in one Redis Cluster
slot, so one script may touch them all.
Nothing is stored without an expiry: a crashed orchestrator leaves nothing
behind for longer than the TTL.

A generating (ACTIVE) session's lease names the orchestrator that runs it. The
write that makes a record ACTIVE takes the lease, every later write of it and a
renewal every third of ``LEASE_S`` keep it, and the write that ends the turn
drops it. A record that says ACTIVE with no lease belongs to a dead orchestrator:
another one may continue, cancel or close the session at once.

KV snapshot chunks (``--kv-snapshots``, :mod:`specserve.orchestrator.snapshots.kv_snapshots`)
are content-addressed: ``<chunk key>`` is the hex of the chunk's chained hash
(:mod:`specserve.engine.kv_chunks`), so sessions with a common token prefix under
one model share its chunks. They are never deleted by a session's end (another
session may use them); they expire ``KV_TTL_S`` after they were last written or
read.
"""

from __future__ import annotations

PREFIX = "specserve:"
SESSION_PREFIX = PREFIX + "session:"
CANCEL_PREFIX = PREFIX + "cancel:"
KV_PREFIX = PREFIX + "kv:"
LEASE_PREFIX = PREFIX + "lease:"

# Hash fields of a session key.
FIELD_VERSION = "v"
FIELD_RECORD = "r"
FIELD_TOKENS = "t"  # schema 2: tokens appended since ``r`` was written
FIELD_DELTA = "d"  # schema 2: the latest SessionDelta
FIELD_CANCELLED = "c"  # '1': CancelSession cancelled the session (never cleared)

# A kept session lives this long after its last write (every round and every turn writes).
SESSION_TTL_S = 3600.0
# A cancel request outlives the round in flight by far; the final write removes it.
CANCEL_TTL_S = 60.0
# A KV snapshot chunk lives this long after it was last written or read (by a restore,
# or by the export that found it present). Short: chunks are large and only a cache.
KV_TTL_S = 900.0
# A generating session's lease lasts this long unless its orchestrator renews it (every
# third of it, whatever its rounds are doing): after a crash, another orchestrator may
# take the session over this long after the last renewal.
LEASE_S = 5.0


def session_key(session_id: str) -> str:
    """The hash holding a session's record."""
    return f"{SESSION_PREFIX}{{{session_id}}}"


def cancel_key(session_id: str) -> str:
    """The flag CancelSession sets for whichever orchestrator replica runs the session (its
    signal; the durable mark is the session hash's ``c``)."""
    return f"{CANCEL_PREFIX}{{{session_id}}}"


def lease_key(session_id: str) -> str:
    """The lease of the orchestrator generating a session (its value: that one's id)."""
    return f"{LEASE_PREFIX}{{{session_id}}}"


def kv_key(chunk_key: bytes) -> str:
    """The string holding one KV snapshot chunk (``chunk_key``: its chained hash)."""
    return f"{KV_PREFIX}{chunk_key.hex()}"
