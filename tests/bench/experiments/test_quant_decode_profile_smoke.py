"""bench.experiments.quant_decode_profile on a tiny decoder: the Q4_K_M typing, and a profile that
splits a forward's time into the quantized products and the rest."""

from __future__ import annotations

import pytest

from bench.experiments import quant_decode_profile as qdp
from specserve.engine import cpu_kernels
from specserve.engine.quant import GGMLType, QuantizedWeight
from specserve.engine.tiny import tiny_config


def test_q4_k_m_gives_more_bits_to_v_and_down_in_the_outer_layers() -> None:
    types = [qdp.q4_k_m_type(i, 28, "down_proj") for i in range(28)]
    six = [i for i, t in enumerate(types) if t == GGMLType.Q6_K]
    assert six == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert qdp.q4_k_m_type(0, 28, "q_proj") == GGMLType.Q4_K


def test_a_tiny_profile_names_the_quantized_products() -> None:
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels are not available here")
    cfg = tiny_config(hidden_size=256, intermediate_size=512, head_dim=64, tie_word_embeddings=True)
    model = qdp.synthetic_model(cfg)
    assert isinstance(model.lm_head.weight, QuantizedWeight)
    table = qdp.profile(model, rows=2, context=40, steps=1)
    assert table[0][0] == "total (wall)" and table[0][1] > 0
    assert any("q8_linears" in op for op, _ in table[1:]), table
