"""Redis key names and lifetimes: every key the orchestrator writes, in one place.

==============================  =====================  ==========================================
key                             type                   lifetime
==============================  =====================  ==========================================
``specserve:session:{<id>}``    hash ``v``, ``r``      ``SESSION_TTL_S`` from the last write; a
                                                       running generation rewrites it every round
``specserve:cancel:{<id>}``     string (``1``)         ``CANCEL_TTL_S``; removed by the final write
``specserve:kv:<chunk key>``    string: a serialized   ``KV_TTL_S`` (``--kv-snapshot-ttl-s``)
                                ``KvChunk``            from its last write or read
==============================  =====================  ==========================================

A session hash holds ``v``, the record's version as a decimal integer (what the
commit script compares), and ``r``, the serialized ``specserve.v1.SessionRecord``.
Keeping the version beside the bytes lets a Lua script check it without parsing
protobuf. The ``{<id>}`` hash tag puts a session's two keys in one Redis Cluster
slot, so one script may touch both. Nothing is stored without an expiry: a
crashed orchestrator leaves nothing behind for longer than the TTL.

KV snapshot chunks (``--kv-snapshots``, :mod:`specserve.orchestrator.kv_snapshots`)
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

# Hash fields of a session key.
FIELD_VERSION = "v"
FIELD_RECORD = "r"

# A kept session lives this long after its last write (every round and every turn writes).
SESSION_TTL_S = 3600.0
# A cancel request outlives the round in flight by far; the final write removes it.
CANCEL_TTL_S = 60.0
# A KV snapshot chunk lives this long after it was last written or read (by a restore,
# or by the export that found it present). Short: chunks are large and only a cache.
KV_TTL_S = 900.0
# An ACTIVE record not written for this long belongs to a dead orchestrator: another
# replica may take the session over. Generous against slow rounds (a long prefill).
ACTIVE_STALE_S = 120.0


def session_key(session_id: str) -> str:
    """The hash holding a session's record."""
    return f"{SESSION_PREFIX}{{{session_id}}}"


def cancel_key(session_id: str) -> str:
    """The flag CancelSession sets for whichever orchestrator replica runs the session."""
    return f"{CANCEL_PREFIX}{{{session_id}}}"


def kv_key(chunk_key: bytes) -> str:
    """The string holding one KV snapshot chunk (``chunk_key``: its chained hash)."""
    return f"{KV_PREFIX}{chunk_key.hex()}"
