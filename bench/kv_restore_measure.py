"""The client side of :mod:`bench.kv_restore`: what it times against a target server.

:func:`measure_target` connects to a target, asks for its KV fingerprint and, for
every context length, prefills a source session, saves its chunks and then times,
round by round with a fresh session each time, a re-prefill, a restore (Redis reads,
``ImportKv``, the tail's ``Verify``) and a save (:func:`measure`, one :class:`Length`
per length); :func:`compression` checks whether zlib would shrink the stored chunks.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc.aio

from bench.common import Samples
from specserve.engine.kv_chunks import chain_keys
from specserve.orchestrator.fleet.replicas import channel_options
from specserve.orchestrator.snapshots.kv_chain import (
    ChainParams,
    TargetKv,
    restore_chain,
    save_chain,
    target_kv,
)
from specserve.orchestrator.snapshots.kv_store import ChunkStore
from specserve.orchestrator.store import keys
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc

VARIANTS = ("re-prefill", "restore", "save")


@dataclass
class Length:
    """Everything measured for one context length."""

    tokens: int
    chunks: int = 0  # whole chunks restored: (tokens - 1) // chunk_tokens
    chunk_bytes: int = 0  # serialized KvChunk bytes of all of them (what Redis holds)
    times: dict[str, Samples] = field(default_factory=lambda: {v: Samples() for v in VARIANTS})
    get_s: Samples = field(default_factory=Samples)  # restore: reading Redis
    import_s: Samples = field(default_factory=Samples)  # restore: ImportKv calls
    tail_s: Samples = field(default_factory=Samples)  # restore: the tail's Verify
    busy_prefill_s: Samples = field(default_factory=Samples)  # target model thread, re-prefill
    busy_restore_s: Samples = field(default_factory=Samples)  # ... ImportKv + tail forward
    same_token: list[bool] = field(default_factory=list)
    logp_diff: list[float] = field(default_factory=list)  # |log p restore - log p prefill|


def context_tokens(n: int) -> list[int]:
    """Deterministic ids below 256 (inside any vocabulary, the tiny models' too); the
    timings do not depend on the values."""
    return [(i * 7919 + 13) % 251 + 3 for i in range(n)]


class Bench:
    """The client side: one channel to the target, one chunk store."""

    def __init__(self, stub: target_pb2_grpc.TargetServiceStub, store: ChunkStore) -> None:
        self.stub = stub
        self.store = store

    async def prefill(self, sid: str, tokens: list[int]) -> tuple[float, Any]:
        session = target_pb2.PrefillSession(session_id=sid, tokens=tokens, return_logprobs=True)
        t0 = time.perf_counter()
        r = await self.stub.Prefill(target_pb2.PrefillRequest(sessions=[session]), timeout=600)
        return time.perf_counter() - t0, r

    async def release(self, sid: str) -> None:
        await self.stub.Release(common_pb2.ReleaseRequest(session_ids=[sid]), timeout=60)


async def measure(
    bench: Bench,
    kv: TargetKv,
    params: ChainParams,
    lengths: Sequence[int],
    tail: int,
    reps: int,
    warmup: int,
) -> list[Length]:
    c = params.chunk_tokens
    out = []
    for n in lengths:
        row = Length(n)
        tokens = context_tokens(n + tail)
        whole = (n + tail - 1) // c * c
        row.chunks = whole // c
        src = f"src-{n}"
        await bench.prefill(src, tokens)
        await save_chain(bench.store, bench.stub, src, tokens[:whole], kv, params)
        chunk_keys = chain_keys(kv.fingerprint, tokens[:whole], c)
        row.chunk_bytes = sum(len(v or b"") for v in await bench.store.get(chunk_keys))
        for rnd in range(warmup + reps):
            keep = rnd >= warmup
            # re-prefill
            sid = f"prefill-{n}-{rnd}"
            seconds, response = await bench.prefill(sid, tokens)
            want = response.results[0]
            if keep:
                row.times["re-prefill"].times.append(seconds)
                row.busy_prefill_s.times.append(response.compute_ns / 1e9)
            await bench.release(sid)
            # restore
            sid = f"restore-{n}-{rnd}"
            t0 = time.perf_counter()
            done = await restore_chain(bench.store, bench.stub, sid, tokens[:whole], kv, params)
            t1 = time.perf_counter()
            assert done.tokens == whole, f"restored {done.tokens} of {whole} tokens"
            session = target_pb2.VerifySession(
                session_id=sid,
                start=done.tokens,
                new_tokens=tokens[done.tokens :],
                return_logprobs=True,
            )
            request = target_pb2.VerifyRequest(sessions=[session], strict=True)
            verified = await bench.stub.Verify(request, timeout=600)
            t2 = time.perf_counter()
            got = verified.results[0]
            if keep:
                row.times["restore"].times.append(t2 - t0)
                row.get_s.times.append(done.get_ns / 1e9)
                row.import_s.times.append(done.import_ns / 1e9)
                row.tail_s.times.append(t2 - t1)
                row.busy_restore_s.times.append((done.target_ns + verified.compute_ns) / 1e9)
                row.same_token.append(got.next_token == want.next_token)
                row.logp_diff.append(abs(got.logprobs[0] - want.logprobs[0]))
            await bench.release(sid)
            # save (from the source session, with the chunks gone)
            await bench.store.redis.delete(*[keys.kv_key(k) for k in chunk_keys])
            t0 = time.perf_counter()
            await save_chain(bench.store, bench.stub, src, tokens[:whole], kv, params)
            if keep:
                row.times["save"].times.append(time.perf_counter() - t0)
        await bench.release(src)
        print(summary_line(row), flush=True)
        out.append(row)
    return out


async def compression(
    store: ChunkStore, kv: TargetKv, params: ChainParams, n: int
) -> dict[str, float]:
    """zlib level 1 over the stored chunks of the longest context: is it worth it?"""
    tokens = context_tokens(n)
    whole = n // params.chunk_tokens * params.chunk_tokens
    found = await store.get(chain_keys(kv.fingerprint, tokens[:whole], params.chunk_tokens))
    values = [v for v in found if v]
    if not values:
        return {}
    raw = sum(len(v) for v in values)
    t0 = time.perf_counter()
    packed = [zlib.compress(v, 1) for v in values]
    t1 = time.perf_counter()
    for p in packed:
        zlib.decompress(p)
    t2 = time.perf_counter()
    return {
        "bytes": raw,
        "ratio": raw / sum(len(p) for p in packed),
        "compress_mb_s": raw / (t1 - t0) / 1e6,
        "decompress_mb_s": raw / (t2 - t1) / 1e6,
    }


async def measure_target(
    address: str,
    store: ChunkStore,
    params: ChainParams,
    lengths: Sequence[int],
    tail: int,
    reps: int,
    warmup: int,
) -> tuple[list[Length], dict[str, float], TargetKv]:
    """:func:`measure` and :func:`compression` against the target server at ``address``;
    also returns what the target said of its KV."""
    async with grpc.aio.insecure_channel(address, options=channel_options()) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        kv = await target_kv(stub, 60)
        if not kv.fingerprint:
            raise SystemExit("the target does not export KV (tensor-parallel?)")
        bench = Bench(stub, store)
        rows = await measure(bench, kv, params, lengths, tail, reps, warmup)
        comp = await compression(store, kv, params, lengths[-1])
    return rows, comp, kv


def summary_line(row: Length) -> str:
    """The line printed once a length is measured."""
    p, r = row.times["re-prefill"].median, row.times["restore"].median
    return (
        f"{row.tokens} tokens: re-prefill {p * 1e3:.1f} ms, restore {r * 1e3:.1f} ms "
        f"({p / r:.2f}x), save {row.times['save'].median * 1e3:.1f} ms"
    )
