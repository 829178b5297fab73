"""KV snapshots end to end: a lost target's sessions resume on another from saved chunks.

Real processes (two targets, a draft, an orchestrator with ``--kv-snapshots``) on a
real Redis. The output must equal target-only greedy decoding, drafts must be
proposed and accepted, and the restore path must really have been taken: the new
target imported chunks and was sent only the tail, never the whole history.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from specserve.client import Client
from specserve.orchestrator.store import keys
from specserve.orchestrator.store.redis_settings import RedisSettings
from specserve.orchestrator.store.session_store import SessionStore
from tests.orchestrator.redis_server import free_port
from tests.orchestrator.stack import Reference, Stack, kv_used, redis_keys, stored_record

pytestmark = pytest.mark.redis

PROMPT = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
LONG = 800
CHUNK = 16
TTL_S = 60
SNAPSHOTS = ["--kv-snapshots", "--kv-snapshot-chunk-tokens", str(CHUNK)]
SNAPSHOTS += ["--kv-snapshot-ttl-s", str(TTL_S)]


@pytest.fixture
def two_targets(redis_url: str) -> Iterator[Stack]:
    s = Stack(redis_url, targets=2, orchestrator_args=SNAPSHOTS)
    try:
        yield s.start()
    finally:
        s.stop()


def total(stack: Stack, name: str) -> float:
    return sum(stack.metric(f"specserve_orchestrator_{name}").values())


def kv_ttls(url: str) -> dict[str, float]:
    """Seconds left of every KV snapshot key."""

    async def go() -> dict[str, float]:
        store = SessionStore(RedisSettings.from_url(url).client())
        try:
            found = [k for k in await store.keys() if k.startswith(keys.KV_PREFIX)]
            return {k: await store.ttl_s(k) for k in found}
        finally:
            await store.close()

    return asyncio.run(go())


def non_kv(url: str) -> list[str]:
    return [k for k in redis_keys(url) if not k.startswith(keys.KV_PREFIX)]


def test_lost_target_resumes_from_snapshots_with_unchanged_output(
    two_targets: Stack, reference: Reference
) -> None:
    stack = two_targets
    expected = reference.decode(PROMPT, LONG)
    before = non_kv(stack.redis_url)
    with Client(stack.address, timeout_s=120) as c:
        stream = iter(c.stream(PROMPT, max_new_tokens=LONG, k=4))
        deltas = [next(stream)]
        sid = deltas[0].session_id
        while True:  # until the record says three chunks are in the store
            record = stored_record(stack.redis_url, sid)
            assert record is not None
            if record.kv_snapshot.chunks >= 3:
                break
            deltas.append(next(stream))
        assert record.kv_snapshot.chunk_tokens == CHUNK
        assert len(record.kv_snapshot.head) == 32 and len(record.kv_snapshot.fingerprint) == 32
        victim = next(t for t in stack.target_procs if t.address == record.target.endpoint)
        survivor = next(t for t in stack.target_procs if t is not victim)
        assert victim.proc is not None
        victim.proc.kill()
        deltas.extend(stream)
    assert [t for d in deltas for t in d.token_ids] == expected
    usage = deltas[-1].usage
    assert usage is not None and usage.drafted_tokens > 0 and usage.accepted_tokens > 0
    assert total(stack, "target_failovers") >= 1
    # The restore path: chunks imported on the survivor, only the tail verified after them.
    assert total(stack, "kv_restores") == 1
    restored = total(stack, "kv_tokens_restored")
    assert restored >= 3 * CHUNK and restored % CHUNK == 0
    assert total(stack, "kv_chunks_imported") == restored // CHUNK
    assert 0 < total(stack, "kv_tail_tokens") <= 5 * CHUNK  # the export kept up within chunks
    assert total(stack, "target_history_resends") == 0  # the survivor never asked for it all
    assert total(stack, "kv_restore_failures") == 0
    # Session keys go back to what they were; snapshot chunks remain, each with a TTL.
    deadline = time.monotonic() + 10
    while kv_used(survivor.address, "target")[0] or non_kv(stack.redis_url) != before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ttls = kv_ttls(stack.redis_url)
    assert len(ttls) >= 3
    assert all(0 < t <= TTL_S for t in ttls.values()), ttls


def test_equal_prompts_share_their_chunks(redis_url: str, reference: Reference) -> None:
    stack = Stack(redis_url, orchestrator_args=SNAPSHOTS)
    prompt = [(i * 7 + 3) % 256 for i in range(70)]  # four whole chunks before decoding starts
    try:
        stack.start()
        expected = reference.decode(prompt, 30)
        with Client(stack.address, timeout_s=120) as c:
            first = c.generate(prompt, max_new_tokens=30, k=4)
            deadline = time.monotonic() + 10
            while total(stack, "kv_chunks_exported") < 4:  # the prompt's chunks are saved
                assert time.monotonic() < deadline
                time.sleep(0.05)
            saved = set(kv_ttls(redis_url))
            exported = total(stack, "kv_chunks_exported")
            second = c.generate(prompt, max_new_tokens=30, k=4)
            while total(stack, "kv_chunks_found") < 4:  # the second session found them stored
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert first.token_ids == second.token_ids == expected
        assert saved <= set(kv_ttls(redis_url))
        # The second session's export found the prompt's chunks and exported at most the rest.
        assert total(stack, "kv_chunks_exported") - exported <= (100 - 64) // CHUNK
    finally:
        stack.stop()


def test_a_dead_snapshot_store_changes_nothing(redis_url: str, reference: Reference) -> None:
    """Every save fails and the failover finds nothing: the request still gets its
    exact output, through the ordinary re-prefill."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    args = [*SNAPSHOTS, "--kv-snapshot-redis-url", dead]
    stack = Stack(redis_url, targets=2, orchestrator_args=args)
    try:
        stack.start()
        expected = reference.decode(PROMPT, LONG)
        with Client(stack.address, timeout_s=120) as c:
            stream = iter(c.stream(PROMPT, max_new_tokens=LONG, k=4))
            deltas = [next(stream)]
            deadline = time.monotonic() + 20
            while total(stack, "kv_export_failures") < 1:
                assert time.monotonic() < deadline
                deltas.append(next(stream))
            record = stored_record(redis_url, deltas[0].session_id)
            assert record is not None and not record.HasField("kv_snapshot")
            victim = next(t for t in stack.target_procs if t.address == record.target.endpoint)
            assert victim.proc is not None
            victim.proc.kill()
            deltas.extend(stream)
        assert [t for d in deltas for t in d.token_ids] == expected
        usage = deltas[-1].usage
        assert usage is not None and usage.drafted_tokens > 0 and usage.accepted_tokens > 0
        assert total(stack, "target_failovers") >= 1
        assert total(stack, "kv_restores") == 0
        assert total(stack, "kv_restore_failures") + total(stack, "kv_restore_misses") >= 1
    finally:
        stack.stop()
