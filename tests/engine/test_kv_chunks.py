"""KV snapshot chunks: chained keys, the model fingerprint, and K/V as bytes."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.errors import InvalidArgument
from specserve.engine.kv_chunks import (
    KEY_BYTES,
    ROOT_KEY,
    KvLayout,
    chain_key,
    chain_keys,
    kv_from_bytes,
    kv_to_bytes,
    model_fingerprint,
)
from specserve.engine.tiny import tiny_model

FP = bytes(range(32))
TOKENS = [(i * 37 + 5) % 256 for i in range(100)]


def test_keys_chain_over_whole_chunks() -> None:
    keys = chain_keys(FP, TOKENS, 16)
    assert len(keys) == 6  # 100 tokens: 6 whole chunks of 16, the last 4 have no key
    assert all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 6
    assert keys[0] == chain_key(ROOT_KEY, FP, TOKENS[:16])
    assert keys[3] == chain_key(keys[2], FP, TOKENS[48:64])
    assert chain_keys(FP, TOKENS, 16, first=4) == keys[4:]
    assert chain_keys(FP, TOKENS[:15], 16) == []


def test_sessions_sharing_a_prefix_share_its_chunks() -> None:
    other = TOKENS[:40] + [7] * 60  # same first 40 tokens: chunks 0 and 1 (0..31) agree
    a, b = chain_keys(FP, TOKENS, 16), chain_keys(FP, other, 16)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


@pytest.mark.parametrize("position", [0, 17, 50, 95])
def test_changing_one_token_changes_its_chunk_and_every_later_key(position: int) -> None:
    changed = list(TOKENS)
    changed[position] = (changed[position] + 1) % 256
    a, b = chain_keys(FP, TOKENS, 16), chain_keys(FP, changed, 16)
    cut = position // 16
    assert a[:cut] == b[:cut]
    assert all(x != y for x, y in zip(a[cut:], b[cut:], strict=True))


def test_the_same_tokens_under_another_fingerprint_share_no_key() -> None:
    a = chain_keys(FP, TOKENS, 16)
    b = chain_keys(bytes(32), TOKENS, 16)
    assert not set(a) & set(b)


def test_chunk_size_is_bounded() -> None:
    with pytest.raises(InvalidArgument, match="chunk_tokens"):
        chain_keys(FP, TOKENS, 0)


def test_fingerprint_tells_models_and_dtypes_apart() -> None:
    a1 = tiny_model(3)
    fp = model_fingerprint(a1, a1.config, torch.float32)
    assert len(fp) == KEY_BYTES
    a2 = tiny_model(3)  # the same weights loaded again: the same fingerprint
    assert model_fingerprint(a2, a2.config, torch.float32) == fp
    b = tiny_model(4)
    assert model_fingerprint(b, b.config, torch.float32) != fp
    assert model_fingerprint(a1, a1.config, torch.bfloat16) != fp  # another cache dtype
    with torch.no_grad():  # one weight of one layer differs (a fine-tune, a patch)
        a2.model.layers[1].self_attn.k_proj.weight[0, 0] += 1.0
    assert model_fingerprint(a2, a2.config, torch.float32) != fp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_bytes_round_trip(dtype: torch.dtype) -> None:
    layout = KvLayout(3, 2, 8, str(dtype).removeprefix("torch."))
    kv = torch.randn(layout.shape(5)).to(dtype)
    data = kv_to_bytes(kv)
    assert len(data) == layout.bytes_per_token * 5
    back = kv_from_bytes(data, layout, 5)
    assert back.dtype == dtype and torch.equal(back, kv)
    with pytest.raises(InvalidArgument, match=f"holds {len(data)} bytes, got {len(data) - 2}"):
        kv_from_bytes(data[:-2], layout, 5)


def test_layout_rejects_unknown_dtypes() -> None:
    with pytest.raises(InvalidArgument, match="int8"):
        KvLayout(2, 2, 16, "int8")
