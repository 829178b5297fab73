"""The index tensors of one forward: what every layer reads of a ragged batch."""

from __future__ import annotations

from specserve.engine.forward_plan import plan_forward
from specserve.engine.kv_cache import KVPool
from specserve.engine.model import SeqInput


def _pool() -> KVPool:
    return KVPool(num_layers=1, num_kv_heads=1, head_dim=1, budget_bytes=16 * 4 * 8, block_size=4)


def test_a_ragged_plan_indexes_every_token_of_every_session() -> None:
    pool = _pool()
    pool.reserve({"b": 6})  # b's blocks first: a's slots do not start at 0
    pool.reserve({"a": 7})
    pool.advance("a", 5)  # a holds 5 tokens, b 2
    pool.advance("b", 2)
    seqs = [SeqInput("a", [11, 12], num_logits=2), SeqInput("b", [21, 22, 23], num_logits=1)]
    plan = plan_forward(seqs, pool, None)

    assert plan.token_ids.tolist() == [11, 12, 21, 22, 23]
    assert plan.positions.tolist() == [5, 6, 2, 3, 4]
    assert plan.token_session.tolist() == [0, 0, 1, 1, 1]
    assert plan.logit_rows.tolist() == [0, 1, 4]
    assert plan.max_position == 6
    a_slots, b_slots = pool.slots("a", 0, 7).tolist(), pool.slots("b", 0, 5).tolist()
    assert plan.write_slots.tolist() == a_slots[5:] + b_slots[2:]
    assert plan.read_slots.tolist() == [a_slots, [*b_slots, 0, 0]]
    assert (plan.batch, plan.max_new) == (2, 3)
    assert plan.pad_index is not None and plan.pad_index.tolist() == [0, 1, 3, 4, 5]
    mask = plan.mask
    assert mask is not None and mask.shape == (2, 1, 3, 7)
    # a's queries sit at 5 and 6, its third row is padding (key 0 only); b's at 2, 3, 4
    expected = [
        [[k <= 5 for k in range(7)], [k <= 6 for k in range(7)], [k == 0 for k in range(7)]],
        [[k <= q for k in range(7)] for q in (2, 3, 4)],
    ]
    assert mask[:, 0].tolist() == expected


def test_a_sliding_window_hides_keys_past_it() -> None:
    pool = _pool()
    pool.reserve({"a": 6})
    pool.advance("a", 4)
    plan = plan_forward([SeqInput("a", [1, 2])], pool, sliding_window=2)
    assert plan.mask is not None
    expected = [[2 < k <= 4 for k in range(6)], [3 < k <= 5 for k in range(6)]]
    assert plan.mask[0, 0].tolist() == expected  # queries at 4 and 5, a window of 2


def test_one_session_decoding_one_token_needs_no_mask_and_no_padding() -> None:
    pool = _pool()
    pool.reserve({"a": 9})
    pool.advance("a", 8)
    plan = plan_forward([SeqInput("a", [7])], pool, None)
    assert plan.mask is None and plan.pad_index is None
    assert plan.read_slots.tolist() == [pool.slots("a", 0, 9).tolist()]
    assert plan.write_slots.tolist() == pool.slots("a", 8, 9).tolist()
    assert (plan.positions.tolist(), plan.logit_rows.tolist()) == ([8], [0])
