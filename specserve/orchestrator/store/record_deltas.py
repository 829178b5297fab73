"""Session records as deltas (record schema 2): what a round writes instead of the record.

A stored session is three hash fields (see :mod:`specserve.orchestrator.store.keys`):
``r``, the whole ``SessionRecord`` as written when its turn began; ``t``, the
tokens committed since, packed little-endian int32 and appended by each round;
and ``d``, the latest ``SessionDelta``, whose fields replace the record's. A
round therefore writes its new tokens and a few hundred bytes, whatever the
prompt, the stop strings or the sampling parameters weigh; those are written
once, with the turn.

Pure functions, no Redis: :func:`delta_of` builds a write, :func:`assemble` reads one.
"""

from __future__ import annotations

import sys
from array import array

from specserve.orchestrator.errors import RecordError
from specserve.v1 import session_pb2

# The record fields a delta carries; every other field is fixed for the turn.
DELTA_MESSAGES = ("draft", "target", "usage", "kv_snapshot")


def pack_tokens(tokens: list[int]) -> bytes:
    """Token ids as little-endian int32 (the hash's ``t`` field)."""
    packed = array("i", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(raw: bytes, session_id: str) -> list[int]:
    """The inverse of :func:`pack_tokens`; RecordError if ``raw`` is not whole int32s."""
    if len(raw) % 4:
        raise RecordError(f"the stored tokens of session {session_id!r} are corrupt")
    packed = array("i")
    packed.frombytes(raw)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


def delta_of(
    written: session_pb2.SessionRecord, new: session_pb2.SessionRecord
) -> tuple[session_pb2.SessionDelta, bytes]:
    """The delta and the appended tokens that turn the stored ``written`` into ``new``.

    Contract (the round and end-of-turn transitions of :mod:`~specserve.orchestrator.
    records` keep it): ``new`` is ``written`` with tokens appended and only the
    delta's fields changed. ``new`` is already stamped with its version and time.
    """
    before = len(written.tokens)
    assert len(new.tokens) >= before, "a delta only appends tokens"
    assert not before or new.tokens[before - 1] == written.tokens[before - 1]
    delta = session_pb2.SessionDelta(
        version=new.version,
        state=new.state,
        round_index=new.round_index,
        updated_unix_ms=new.updated_unix_ms,
        tokens=len(new.tokens),
    )
    for name in DELTA_MESSAGES:
        if new.HasField(name):
            getattr(delta, name).CopyFrom(getattr(new, name))
    return delta, pack_tokens(list(new.tokens[before:]))


def assemble(
    record: session_pb2.SessionRecord, tokens: bytes | None, delta: bytes | None
) -> session_pb2.SessionRecord:
    """The record a hash holds: ``r`` (parsed, modified in place), ``t`` appended, ``d`` set.

    Raises RecordError when the parts do not fit together (a corrupt hash).
    """
    sid = record.session_id
    if tokens:
        record.tokens.extend(unpack_tokens(tokens, sid))
    if not delta:
        return record
    d = session_pb2.SessionDelta()
    try:
        d.ParseFromString(delta)
    except Exception as e:  # DecodeError and friends: the bytes are not a delta
        raise RecordError(f"the stored delta of session {sid!r} is corrupt: {e}") from e
    if d.tokens != len(record.tokens):
        raise RecordError(
            f"the stored record of session {sid!r} is corrupt: its delta counts {d.tokens} "
            f"tokens, the hash holds {len(record.tokens)}"
        )
    record.version = d.version
    record.state = d.state
    record.round_index = d.round_index
    record.updated_unix_ms = d.updated_unix_ms
    for name in DELTA_MESSAGES:
        if d.HasField(name):
            getattr(record, name).CopyFrom(getattr(d, name))
        else:
            record.ClearField(name)
    return record
