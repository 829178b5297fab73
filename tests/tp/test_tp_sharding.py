"""Sharding without a process group: shapes, head split, and the divisibility errors."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.errors import InvalidArgument, ModelLoadError
from specserve.engine.tp import apply_tp, check_divisible
from tests.support.tiny import tiny_model

pytestmark = pytest.mark.tp


@pytest.mark.parametrize("rank", [0, 1])
def test_shards_keep_whole_heads_and_their_kv_heads(rank: int) -> None:
    whole = tiny_model(0, "qwen2")  # 4 heads, 2 KV heads, head_dim 16, intermediate 128
    model = apply_tp(tiny_model(0, "qwen2"), rank, 2)
    a, w = model.model.layers[1].self_attn, whole.model.layers[1].self_attn
    hd = a.head_dim
    # q heads 2r, 2r+1 and their KV head r, biases alike
    assert torch.equal(a.q_proj.weight, w.q_proj.weight[2 * rank * hd : (2 * rank + 2) * hd])
    assert torch.equal(a.q_proj.bias, w.q_proj.bias[2 * rank * hd : (2 * rank + 2) * hd])
    assert torch.equal(a.k_proj.weight, w.k_proj.weight[rank * hd : (rank + 1) * hd])
    assert torch.equal(a.v_proj.bias, w.v_proj.bias[rank * hd : (rank + 1) * hd])
    assert torch.equal(a.o_proj.weight, w.o_proj.weight[:, 2 * rank * hd : (2 * rank + 2) * hd])
    m, wm = model.model.layers[1].mlp, whole.model.layers[1].mlp
    assert m.gate_proj.weight.shape == (64, 64) and m.up_proj.weight.shape == (64, 64)
    assert torch.equal(m.down_proj.weight, wm.down_proj.weight[:, 64 * rank : 64 * (rank + 1)])
    assert a.o_proj.weight.is_contiguous() and m.down_proj.weight.is_contiguous()
    assert (a.q_proj.out_features, a.o_proj.in_features) == (32, 32)
    pool = model.new_kv_pool(1 << 20)
    assert pool.k[0].shape[1:] == (1, hd)  # one of the two KV heads per rank


def test_world_size_one_is_a_no_op() -> None:
    model = tiny_model(0, "llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_tp(model, 0, 1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("overrides", "world", "names", "fits"),
    [
        (
            {},
            3,
            "the attention heads (4), KV heads (2) and MLP intermediate size (128) must",
            "1, 2",
        ),
        ({}, 4, "the KV heads (2) must", "1, 2"),
        ({"num_heads": 6, "num_kv_heads": 3, "intermediate_size": 96}, 2, "KV heads (3)", "1, 3"),
        ({"num_kv_heads": 4, "intermediate_size": 130}, 4, "MLP intermediate size (130)", "1, 2"),
    ],
)
def test_indivisible_model_is_a_clear_error(
    overrides: dict, world: int, names: str, fits: str
) -> None:
    model = tiny_model(0, "qwen2", **overrides)
    with pytest.raises(ModelLoadError) as err:
        apply_tp(model, 0, world)
    message = str(err.value)
    assert names in message and f"over {world} tensor-parallel ranks" in message
    assert message.endswith(f"TP sizes that fit this model: {fits}")
    check_divisible(tiny_model(0, "qwen2"), 2)  # 4 heads / 2 KV heads / 128 split in two


def test_bad_rank_and_double_sharding_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        apply_tp(tiny_model(0, "llama"), 2, 2)
    model = apply_tp(tiny_model(0, "llama"), 0, 2)
    with pytest.raises(InvalidArgument, match="already applied"):
        apply_tp(model, 0, 2)
