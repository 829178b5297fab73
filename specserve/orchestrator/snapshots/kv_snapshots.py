"""KV snapshots: each session's target KV saved to Redis in chunks, restored on failover.

Off by default (``--kv-snapshots``). The chunk format and keys are
:mod:`specserve.engine.kv_chunks`'s: chunk ``i`` holds positions ``[i * c, (i + 1)
* c)`` and is named by a chained hash of the token prefix through it under the
target's model fingerprint, so equal prefixes share chunks across sessions, as in
LMCache.

* **Saving**, off the round's critical path. After a round commits, a session
  whose target now holds at least ``every_chunks`` whole chunks more than are
  saved gets one background task (one at a time per session, ``max_exports`` in
  all). It computes the keys of every whole chunk the target holds, asks the
  store which exist (which restarts their TTL), has the target ``ExportKv`` the
  chunks from the first missing one on, in calls of at most ``max_call_bytes``,
  and stores them. The last committed token is never in the target's cache, so
  neither is it in a snapshot.
* **Restoring**, when a target is lost and the round in flight moves to another
  (:meth:`KvSnapshots.restore`, before the replay): the longest chain of stored
  chunks of the session's committed tokens under the new target's fingerprint
  is read and ``ImportKv``-ed onto it, and the session's ``target_start``
  becomes the tokens restored, so the replayed ``Verify`` sends only the tail
  (at least one token: a verify needs one, so at most ``(len - 1) // c`` chunks).
* **Failures never fail a request.** A snapshot that cannot be saved is logged
  and counted. A restore that finds nothing, or fails (Redis down, the new
  target refuses: another model or dtype, tensor-parallel, KV budget full),
  falls back to the re-prefill, keeping whatever prefix an earlier import call
  of the same restore built.

How far a session's chain reaches is noted in its record (``kv_snapshot``) by the
next round commit, through the usual versioned Lua script; restoring reads the
store, not the record.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from specserve.engine.errors import EngineError
from specserve.engine.kv_chunks import MAX_CHUNK_TOKENS
from specserve.orchestrator.fleet.replicas import ReplicaPool
from specserve.orchestrator.session import LiveSession
from specserve.orchestrator.snapshots.kv_chain import (
    ChainParams,
    Restored,
    TargetKv,
    restore_chain,
    save_chain,
    target_kv,
)
from specserve.orchestrator.snapshots.kv_store import ChunkStore
from specserve.orchestrator.store import keys
from specserve.v1 import session_pb2

log = logging.getLogger(__name__)

# A target's fingerprint is asked again after this (a replica restarted with another model).
TARGET_INFO_TTL_S = 30.0
# Codes after which a target's fingerprint is asked again (a restart, another model).
_REFRESH_CODES = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED})


@dataclass(frozen=True)
class SnapshotConfig:
    """The ``--kv-snapshot*`` flags."""

    enabled: bool = False
    chunk_tokens: int = 64  # positions per chunk
    every_chunks: int = 1  # export once this many new whole chunks are held
    ttl_s: float = keys.KV_TTL_S
    max_call_bytes: int = 32 << 20  # chunk data per ExportKv / ImportKv call
    max_exports: int = 4  # export tasks in flight
    timeout_s: float = 30.0  # per RPC

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_tokens <= MAX_CHUNK_TOKENS:
            raise ValueError(
                f"kv snapshot chunk_tokens must be in 1..{MAX_CHUNK_TOKENS}, "
                f"got {self.chunk_tokens}"
            )
        if self.every_chunks < 1 or self.max_exports < 1:
            raise ValueError("every_chunks and max_exports must be >= 1")
        if self.ttl_s <= 0 or self.timeout_s <= 0 or self.max_call_bytes < 1:
            raise ValueError("KV snapshot TTL, timeout and call size must be > 0")

    @property
    def chain(self) -> ChainParams:
        return ChainParams(self.chunk_tokens, self.max_call_bytes, self.timeout_s)


@dataclass
class SnapshotStats:
    """Counters for the metrics (see :mod:`specserve.orchestrator.metrics`)."""

    chunks_exported: int = 0
    bytes_exported: int = 0
    chunks_found: int = 0  # already stored (another session's prefix, an earlier export)
    export_failures: int = 0
    restores: int = 0  # sessions that restored at least one chunk
    restore_misses: int = 0  # nothing stored for the session's prefix (and nothing failed)
    restore_failures: int = 0  # Redis or the target failed; fell back to re-prefill
    chunks_imported: int = 0
    tokens_restored: int = 0
    tail_tokens: int = 0  # committed tokens a restored session's target still had to prefill
    restore_ns: int = 0  # summed over the restores


@dataclass
class _Chain:
    """What is saved of one live session: whole chunks from position 0."""

    fingerprint: bytes = b""
    chunks: int = 0
    task: asyncio.Task[None] | None = None


class KvSnapshots:
    """Saves sessions' target KV in the chunk store and restores it onto another target."""

    def __init__(self, config: SnapshotConfig, chunks: ChunkStore, targets: ReplicaPool) -> None:
        self.config = config
        self.chunks = chunks
        self.targets = targets
        self.stats = SnapshotStats()
        self._chains: weakref.WeakKeyDictionary[LiveSession, _Chain] = weakref.WeakKeyDictionary()
        self._targets: dict[str, TargetKv] = {}
        self._exports = asyncio.Semaphore(config.max_exports)
        self._tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.chunks.close()

    # -- saving --------------------------------------------------------------------------

    def after_commit(self, placed: Sequence[tuple[str, LiveSession]]) -> None:
        """Start exporting the newly held whole chunks of ``(target endpoint, session)``s."""
        c = self.config.chunk_tokens
        for target, s in placed:
            known = self._targets.get(target)
            if known is not None and not known.fingerprint and not self._stale(known):
                continue  # a target that exports nothing (tensor-parallel)
            if s.gone or s.done or (s.state.finished and not s.keep):
                continue  # its cache is about to be released
            chain = self._chains.setdefault(s, _Chain())
            if chain.task is not None and not chain.task.done():
                continue  # the next commit looks again
            # Whole chunks of committed tokens the target holds (after a stop cut the
            # round short, it also holds drafts past the last committed token).
            upto = min(s.state.target_start, len(s.state.tokens)) // c
            if upto - chain.chunks < self.config.every_chunks:
                continue
            tokens = s.state.tokens[: upto * c]
            chain.task = self._spawn(self._export(s, chain, target, tokens))

    async def _export(self, s: LiveSession, chain: _Chain, target: str, tokens: list[int]) -> None:
        async with self._exports:
            try:
                await self._save(s, chain, target, tokens)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:  # released meanwhile: nothing to save
                    return
                self._note_failure(target, e.code())
                self.stats.export_failures += 1
                log.info("saving KV of session %s from %s failed: %s", s.sid, target, e.details())
            except (EngineError, DecodeError) as e:
                self.stats.export_failures += 1
                log.info("saving KV of session %s from %s failed: %s", s.sid, target, e)
            except Exception:  # a bug: say so, but a snapshot never fails a request
                self.stats.export_failures += 1
                log.exception("saving KV of session %s from %s failed", s.sid, target)

    async def _save(self, s: LiveSession, chain: _Chain, target: str, tokens: list[int]) -> None:
        info = await self._target(target)
        replica = self.targets.get(target)
        if not info.fingerprint or replica is None:
            return
        try:
            saved = await save_chain(
                self.chunks, replica.stub, s.sid, tokens, info, self.config.chain
            )
        except EngineError:
            self._targets.pop(target, None)  # its model may have changed: ask again
            raise
        known = chain.chunks if chain.fingerprint == info.fingerprint else 0
        self.stats.chunks_found += max(0, saved.found - known)
        self.stats.chunks_exported += saved.exported
        self.stats.bytes_exported += saved.bytes
        chain.fingerprint, chain.chunks = info.fingerprint, saved.chunks
        s.kv_snapshot = session_pb2.KvSnapshot(
            fingerprint=info.fingerprint,
            chunk_tokens=self.config.chunk_tokens,
            chunks=saved.chunks,
            head=saved.head,
        )

    # -- restoring -----------------------------------------------------------------------

    async def restore(self, target: str, sessions: Sequence[LiveSession]) -> None:
        """Import each session's longest stored chain onto ``target``; sets its
        ``target_start`` to the tokens restored (left as it is when nothing is)."""
        await asyncio.gather(*(self._restore(target, s) for s in sessions))

    async def _restore(self, target: str, s: LiveSession) -> None:
        t0 = time.perf_counter_ns()
        tokens = list(s.state.tokens)
        c = self.config.chunk_tokens
        whole = (len(tokens) - 1) // c * c  # the replayed verify needs at least one new token
        replica = self.targets.get(target)
        if whole == 0 or replica is None:
            return
        done = Restored()
        failures = self.stats.restore_failures
        try:
            info = await self._target(target)
            if not info.fingerprint:
                return
            await restore_chain(
                self.chunks, replica.stub, s.sid, tokens[:whole], info, self.config.chain, done
            )
        except grpc.aio.AioRpcError as e:
            self._note_failure(target, e.code())
            self._fell_back(s, target, done.tokens, f"{e.code().name}: {e.details()}")
        except (EngineError, DecodeError) as e:
            self._fell_back(s, target, done.tokens, str(e))
        except Exception as e:  # a bug: say so, but a snapshot never fails a request
            log.exception("restoring session %s on %s failed", s.sid, target)
            self._fell_back(s, target, done.tokens, repr(e))
        self.stats.chunks_imported += done.chunks
        if not done.tokens:
            if self.stats.restore_failures == failures:  # nothing failed: nothing was stored
                self.stats.restore_misses += 1
            return
        s.state.target_start = done.tokens
        elapsed = time.perf_counter_ns() - t0
        self.stats.restores += 1
        self.stats.tokens_restored += done.tokens
        self.stats.tail_tokens += len(tokens) - done.tokens
        self.stats.restore_ns += elapsed
        log.info(
            "session %s: restored %d of %d committed tokens from KV snapshots on %s in "
            "%.1f ms (store %.1f ms, ImportKv %.1f ms); the target prefills the last %d",
            s.sid,
            done.tokens,
            len(tokens),
            target,
            elapsed / 1e6,
            done.get_ns / 1e6,
            done.import_ns / 1e6,
            len(tokens) - done.tokens,
        )

    def _fell_back(self, s: LiveSession, target: str, restored: int, why: str) -> None:
        self.stats.restore_failures += 1
        log.warning(
            "restoring session %s on %s from KV snapshots stopped after %d tokens (%s); "
            "the target re-prefills the rest",
            s.sid,
            target,
            restored,
            why,
        )

    # -- targets -------------------------------------------------------------------------

    async def _target(self, target: str) -> TargetKv:
        """The target's fingerprint and K/V size (GetLoad, cached a while)."""
        known = self._targets.get(target)
        if known is not None and not self._stale(known):
            return known
        replica = self.targets.get(target)
        if replica is None:
            return TargetKv(b"", 0, time.monotonic())
        info = await target_kv(replica.stub, self.config.timeout_s)
        self._targets[target] = info
        return info

    def _stale(self, info: TargetKv) -> bool:
        return time.monotonic() - info.asked > TARGET_INFO_TTL_S

    def _note_failure(self, target: str, code: grpc.StatusCode) -> None:
        if code in _REFRESH_CODES:
            self._targets.pop(target, None)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)
        return task
