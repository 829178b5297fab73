"""KV pool: allocator invariants (property tests) and tensor addressing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.engine.errors import KVBudgetExceeded, NotFound
from specserve.engine.kv_cache import BlockAllocator, KVPool

SESSIONS = [f"s{i}" for i in range(5)]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.sampled_from(SESSIONS), st.integers(0, 40)),
        st.tuples(st.just("advance"), st.sampled_from(SESSIONS), st.integers(0, 40)),
        st.tuples(st.just("truncate"), st.sampled_from(SESSIONS), st.integers(0, 60)),
        st.tuples(st.just("release"), st.sampled_from(SESSIONS), st.just(0)),
    ),
    max_size=60,
)


def _check_invariants(a: BlockAllocator, lengths: dict[str, int]) -> None:
    owned = [b for sid in a.sessions() for b in a.block_table(sid)]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert len(owned) + a.free_blocks == a.num_blocks, "a block leaked"
    assert set(a.sessions()) == set(lengths)
    for sid, n in lengths.items():
        assert a.length(sid) == n
        assert len(a.block_table(sid)) >= a.blocks_needed(n)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 12), block_size=st.integers(1, 8))
def test_allocator_invariants(
    ops: list[tuple[str, str, int]], num_blocks: int, block_size: int
) -> None:
    a = BlockAllocator(num_blocks, block_size)
    lengths: dict[str, int] = {}  # model of the truth
    reserved: dict[str, int] = {}  # tokens reserved beyond the length
    for op, sid, n in ops:
        if op == "reserve":
            try:
                evicted = a.reserve({sid: n})
            except KVBudgetExceeded:
                _check_invariants(a, lengths)  # nothing changed
                continue
            assert sid not in evicted
            for v in evicted:
                lengths.pop(v)
                reserved.pop(v, None)
            lengths.setdefault(sid, 0)
            reserved[sid] = max(reserved.get(sid, 0), n)
        elif op == "advance" and sid in lengths:
            n = min(n, reserved.get(sid, 0))
            a.advance(sid, n)
            lengths[sid] += n
            reserved[sid] -= n
        elif op == "truncate" and sid in lengths:
            if n > lengths[sid]:
                with pytest.raises(ValueError):
                    a.truncate(sid, n)
                continue
            a.truncate(sid, n)
            lengths[sid] = n
            reserved[sid] = 0
            assert len(a.block_table(sid)) == a.blocks_needed(n)
        elif op == "release":
            assert a.release(sid) == (sid in lengths)
            lengths.pop(sid, None)
            reserved.pop(sid, None)
        _check_invariants(a, lengths)


def test_eviction_is_lru_and_spares_protected_sessions() -> None:
    a = BlockAllocator(num_blocks=4, block_size=4)
    for sid in ("old", "mid", "new"):
        a.reserve({sid: 4})
        a.advance(sid, 4)
    a.touch("old")  # now "mid" is least recently used
    evicted = a.reserve({"x": 12}, protect={"mid"})  # 3 blocks, 1 free
    assert evicted == ["new", "old"]
    assert "mid" in a and "x" in a


def test_full_budget_is_a_typed_error_and_changes_nothing() -> None:
    a = BlockAllocator(num_blocks=2, block_size=4)
    a.reserve({"a": 8})
    before = (a.sessions(), a.free_blocks)
    with pytest.raises(KVBudgetExceeded, match="KV cache is full"):
        a.reserve({"b": 4}, protect={"a"})
    assert (a.sessions(), a.free_blocks) == before


def test_unknown_session_is_not_found() -> None:
    with pytest.raises(NotFound, match="no KV cache"):
        BlockAllocator(4, 4).length("ghost")


def test_pool_addresses_slots_through_block_tables() -> None:
    pool = KVPool(
        num_layers=1, num_kv_heads=1, head_dim=2, budget_bytes=4 * 32, block_size=2
    )  # 4 blocks of 2 tokens, float32
    assert pool.stats().blocks_total == 4
    pool.reserve({"a": 3, "b": 2})
    sa, sb = pool.slots("a", 0, 3), pool.slots("b", 0, 2)
    assert len(set(sa.tolist()) | set(sb.tolist())) == 5
    pool.k[0].index_copy_(0, sa, torch.ones(3, 1, 2))
    assert pool.k[0][sb].abs().sum() == 0
    stats = pool.stats()
    assert (stats.sessions, stats.blocks_used) == (2, 3)
    assert stats.bytes_used == 3 * pool.bytes_per_block
    pool.release("a")
    assert pool.stats().blocks_used == 1


def test_budget_smaller_than_a_block_is_rejected() -> None:
    with pytest.raises(KVBudgetExceeded, match="raise the budget"):
        KVPool(num_layers=2, num_kv_heads=2, head_dim=8, budget_bytes=10)


@settings(max_examples=200, deadline=None)
@given(ops=ops, num_blocks=st.integers(2, 12), block_size=st.integers(1, 4))
def test_cached_slot_rows_follow_every_table_change(
    ops: list[tuple[str, str, int]], num_blocks: int, block_size: int
) -> None:
    """Whatever reserves, truncations, evictions and releases did (blocks freed and handed
    out again, ids reused), a session's slots are those of its current block table."""
    elem = 4  # float32, one head of one dimension, one layer: 2 * 4 bytes per token
    pool = KVPool(
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        budget_bytes=num_blocks * block_size * 2 * elem,
        block_size=block_size,
    )
    for op, sid, n in ops:
        if op == "reserve":
            try:
                pool.reserve({sid: n})
            except KVBudgetExceeded:
                continue
        elif op == "advance" and sid in pool:
            room = len(pool.alloc.block_table(sid)) * block_size - pool.length(sid)
            pool.advance(sid, min(n, room))
        elif op == "truncate" and sid in pool and n <= pool.length(sid):
            pool.truncate(sid, n)
        elif op == "release":
            pool.release(sid)
        for held in pool.alloc.sessions():
            table = pool.alloc.block_table(held)
            end = len(table) * block_size
            expected = [table[p // block_size] * block_size + p % block_size for p in range(end)]
            assert pool.host_slots(held, 0, end).tolist() == expected
            assert pool.host_slots(held, end // 2, end).tolist() == expected[end // 2 :]
