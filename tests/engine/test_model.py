"""The decoder matches transformers' own model in float32 (max |logit diff| <= 1e-4)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from specserve.engine import cpu_kernels
from specserve.engine.config import ModelConfig
from specserve.engine.model import CausalLM, SeqInput

TOL = 1e-4

ARCHS = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
    # SmolLM2 is a Llama with tied embeddings and a large rope theta.
    "smollm2": (transformers.LlamaConfig, {"tie_word_embeddings": True, "rope_theta": 100000.0}),
}


def _pair(arch: str, seed: int = 0, **extra: object) -> tuple[torch.nn.Module, CausalLM]:
    cls, kwargs = ARCHS[arch]
    torch.manual_seed(seed)
    hf_cfg = cls(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **{**kwargs, **extra},
    )
    hf_cfg._attn_implementation = "sdpa"
    ref = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():  # random biases, so a bias bug cannot hide behind zeros
        for name, p in ref.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    ours = CausalLM(ModelConfig.from_hf(hf_cfg.to_dict()))
    result = ours.load_state_dict(ref.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return ref, ours


def _reference(ref: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids).logits.float()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_prefill_matches_transformers(arch: str) -> None:
    ref, ours = _pair(arch)
    ids = torch.randint(0, 256, (1, 33), generator=torch.Generator().manual_seed(1))
    kv = ours.new_kv_pool(1 << 20)
    kv.reserve({"s": 33})
    logits = ours([SeqInput("s", ids[0].tolist(), num_logits=33)], kv)
    assert (logits - _reference(ref, ids)[0]).abs().max() <= TOL
    assert kv.length("s") == 33


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_ragged_batch_matches_transformers(arch: str) -> None:
    """Sessions with different cache lengths and different numbers of new tokens
    (prefill, one token, k + 1 tokens) in the same forward."""
    ref, ours = _pair(arch, seed=3)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (3, 40), generator=gen)
    full = _reference(ref, ids)
    kv = ours.new_kv_pool(1 << 20)
    kv.reserve({"a": 40, "b": 40, "c": 40})
    # Step 1: ragged prefills.
    cuts1 = {"a": 17, "b": 3, "c": 30}
    # Step 2: one token, five tokens (a verify of k = 4), and a further prefill chunk.
    cuts2 = {"a": 18, "b": 8, "c": 40}
    prev = dict.fromkeys(cuts1, 0)
    for cuts in (cuts1, cuts2):
        seqs = [
            SeqInput(sid, ids[i, prev[sid] : cuts[sid]].tolist(), num_logits=cuts[sid] - prev[sid])
            for i, sid in enumerate(cuts)
        ]
        logits = ours(seqs, kv)
        row = 0
        for i, sid in enumerate(cuts):
            n = cuts[sid] - prev[sid]
            diff = (logits[row : row + n] - full[i, prev[sid] : cuts[sid]]).abs().max()
            assert diff <= TOL, (sid, float(diff))
            row += n
        prev = dict(cuts)


def test_rollback_then_continue_matches_fresh_prefix() -> None:
    """After truncating a rejected suffix, decoding continues as if it never happened."""
    ref, ours = _pair("qwen2", seed=5)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(7))
    kv = ours.new_kv_pool(1 << 20)
    kv.reserve({"s": 40})
    ours([SeqInput("s", ids[0, :20].tolist())], kv)
    ours([SeqInput("s", [1, 2, 3, 4, 5], num_logits=5)], kv)  # a draft that gets rejected
    kv.truncate("s", 20)
    logits = ours([SeqInput("s", ids[0, 20:24].tolist(), num_logits=4)], kv)
    assert (logits - _reference(ref, ids)[0, 20:24]).abs().max() <= TOL


def test_only_requested_logits_are_returned() -> None:
    _, ours = _pair("llama")
    kv = ours.new_kv_pool(1 << 20)
    kv.reserve({"a": 10, "b": 10})
    out = ours([SeqInput("a", [1, 2, 3], num_logits=1), SeqInput("b", [4, 5], num_logits=2)], kv)
    assert out.shape == (3, 256) and out.dtype == torch.float32


def test_bfloat16_model_runs_and_stays_close() -> None:
    ref, ours = _pair("qwen2", seed=9)
    ours = ours.to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(3))
    kv = ours.new_kv_pool(1 << 20)
    assert kv.dtype == torch.bfloat16
    kv.reserve({"s": 16})
    logits = ours([SeqInput("s", ids[0].tolist(), num_logits=16)], kv)
    assert (logits - _reference(ref, ids)[0]).abs().max() < 0.1


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no CPU kernels (AVX-512 / AVX2)")
def test_bfloat16_weights_computed_in_float32_equal_their_float32_copy() -> None:
    """bfloat16 matrices under float32 compute give, bit for bit, the logits of a float32
    model holding the same (bfloat16-rounded) weights: in a prefill (torch path), in a
    verify forward and in one-token steps (kernels), so verify == decode as in float32."""
    _, base = _pair("qwen2", seed=5)
    half = copy.deepcopy(base).to(torch.bfloat16)
    half.compute_in_float32()
    assert half.dtype == torch.bfloat16 and half.activation_dtype == torch.float32
    wide = copy.deepcopy(base).to(torch.bfloat16).to(torch.float32)
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(6)).tolist()
    out = {}
    for name, model in (("half", half), ("wide", wide)):
        kv = model.new_kv_pool(1 << 20)
        assert kv.dtype == torch.float32
        kv.reserve({"p": 60, "s": 60, "t": 60})
        prefill = model([SeqInput("p", ids[:40], num_logits=40)], kv)
        # (a prompt's rows without logits run apart from its logit rows: s and t alike)
        model([SeqInput("s", ids[:40], num_logits=1)], kv)
        model([SeqInput("t", ids[:40], num_logits=1)], kv)
        verify = model([SeqInput("s", ids[40:45], num_logits=5)], kv)
        steps = torch.cat([model([SeqInput("t", [i])], kv) for i in ids[40:45]])
        assert torch.equal(verify, steps)
        out[name] = (prefill, verify)
    assert all(torch.equal(a, b) for a, b in zip(out["half"], out["wide"], strict=True))


def test_unsupported_architecture_is_a_clear_error() -> None:
    from specserve.engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="not supported"):
        ModelConfig.from_hf({"model_type": "gpt2"})


def test_mistral_sliding_window_matches_transformers() -> None:
    ref, ours = _pair("mistral", seed=11, sliding_window=8)
    assert ours.config.sliding_window == 8
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    kv = ours.new_kv_pool(1 << 20)
    kv.reserve({"s": 30})
    first = ours([SeqInput("s", ids[0, :20].tolist(), num_logits=20)], kv)
    rest = ours([SeqInput("s", ids[0, 20:].tolist(), num_logits=10)], kv)
    full = _reference(ref, ids)[0]
    assert (torch.cat([first, rest]) - full).abs().max() <= TOL
