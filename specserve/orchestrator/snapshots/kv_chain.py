"""One session's KV chunk chain, saved and restored: the RPC and Redis steps, no policy.

:func:`save_chain` and :func:`restore_chain` are what
:class:`~specserve.orchestrator.snapshots.kv_snapshots.KvSnapshots` runs for a session (and
what ``bench/kv_restore.py`` times). Both work in calls of at most
``max_call_bytes`` of chunk data, under the 64 MiB message limit. Errors (gRPC,
the store's ``Unavailable``, a corrupt value) propagate; the caller decides
what a failure means.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.engine.errors import FailedPrecondition
from specserve.engine.kv_chunks import chain_keys
from specserve.orchestrator.snapshots.kv_store import ChunkStore
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc


@dataclass(frozen=True)
class ChainParams:
    chunk_tokens: int = 64  # positions per chunk
    max_call_bytes: int = 32 << 20  # chunk data per ExportKv / ImportKv call
    timeout_s: float = 30.0  # per RPC


@dataclass(frozen=True)
class TargetKv:
    """What a target says about its KV (``GetLoad``)."""

    fingerprint: bytes  # empty: the target neither exports nor imports (tensor-parallel)
    bytes_per_token: int
    asked: float = 0.0  # time.monotonic() of the answer

    def per_call(self, params: ChainParams) -> int:
        """Chunks per ExportKv / ImportKv call."""
        per_chunk = max(1, params.chunk_tokens * self.bytes_per_token)
        return max(1, params.max_call_bytes // per_chunk)


async def target_kv(stub: target_pb2_grpc.TargetServiceStub, timeout_s: float) -> TargetKv:
    load = await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=timeout_s)
    return TargetKv(load.kv_fingerprint, load.kv_bytes_per_token, time.monotonic())


@dataclass(frozen=True)
class Saved:
    """What :func:`save_chain` did."""

    chunks: int  # whole chunks of the prefix, all stored now
    head: bytes  # key of the last one
    found: int  # stored already, from position 0 (shared prefix, earlier save)
    exported: int  # exported from the target and stored
    bytes: int  # K/V bytes exported


async def save_chain(
    store: ChunkStore,
    stub: target_pb2_grpc.TargetServiceStub,
    session_id: str,
    tokens: Sequence[int],
    kv: TargetKv,
    params: ChainParams,
) -> Saved:
    """Store every whole chunk of ``tokens`` (a prefix the target holds): the chunks
    found stored get their TTL restarted, the rest from the first missing one on are
    exported from the target."""
    c = params.chunk_tokens
    keys = chain_keys(kv.fingerprint, tokens, c)
    assert keys, "save at least one whole chunk"
    present = await store.touch(keys)
    first = next((i for i, p in enumerate(present) if not p), len(keys))
    size = 0
    per_call = kv.per_call(params)
    for i in range(first, len(keys), per_call):
        j = min(len(keys), i + per_call)
        request = target_pb2.ExportKvRequest(
            session_id=session_id, chunk_tokens=c, tokens=tokens[: j * c], first_chunk=i
        )
        response = await stub.ExportKv(request, timeout=params.timeout_s)
        if [ch.key for ch in response.chunks] != keys[i:j]:
            raise FailedPrecondition(
                "the target answered chunks under other keys (did its model change?)"
            )
        await store.put([(ch.key, ch.SerializeToString()) for ch in response.chunks])
        size += sum(len(ch.data) for ch in response.chunks)
    return Saved(len(keys), keys[-1], first, len(keys) - first, size)


@dataclass
class Restored:
    """How far :func:`restore_chain` got (filled in as it goes, so a caller that
    catches its error still knows what the target holds)."""

    tokens: int = 0  # the session's cache holds these now
    chunks: int = 0  # imported
    get_ns: int = 0  # reading the store
    import_ns: int = 0  # ImportKv calls
    target_ns: int = 0  # of which the target's model thread spent (compute_ns)


async def restore_chain(
    store: ChunkStore,
    stub: target_pb2_grpc.TargetServiceStub,
    session_id: str,
    tokens: Sequence[int],
    kv: TargetKv,
    params: ChainParams,
    progress: Restored | None = None,
) -> Restored:
    """Import the longest stored chain of whole chunks of ``tokens`` onto the target
    (replacing any cache the session has there)."""
    out = progress if progress is not None else Restored()
    c = params.chunk_tokens
    keys = chain_keys(kv.fingerprint, tokens, c)
    per_call = kv.per_call(params)
    for i in range(0, len(keys), per_call):
        t0 = time.perf_counter_ns()
        values = await store.get(keys[i : i + per_call])
        found = [target_pb2.KvChunk.FromString(v) for v in _prefix(values)]
        t1 = time.perf_counter_ns()
        out.get_ns += t1 - t0
        if not found:
            break
        request = target_pb2.ImportKvRequest(
            session_id=session_id,
            tokens=tokens[: (i + len(found)) * c],
            start=i * c,
            chunks=found,
        )
        response = await stub.ImportKv(request, timeout=params.timeout_s)
        out.import_ns += time.perf_counter_ns() - t1
        out.target_ns += response.compute_ns
        out.tokens = response.tokens
        out.chunks += len(found)
        if len(found) < len(values):
            break  # the chain ends here
    return out


def _prefix(values: list[bytes | None]) -> list[bytes]:
    """The values up to the first missing one."""
    out = []
    for v in values:
        if v is None:
            break
        out.append(v)
    return out
