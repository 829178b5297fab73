"""The families beyond Llama, each against transformers' own model of it.

Per family (Qwen3, Granite, OLMo 2, Phi-3, Gemma 2, Gemma 3, and the mixtures of experts
Qwen3-MoE and Mixtral: 4 experts, top-2), a tiny random model built from
transformers' config class with the family's features on
(tests/support/hf_families.py), loaded three ways: its Hugging Face directory, an F16
GGUF file and a Q8_0 GGUF file (blocks kept). The engine's logits equal
transformers' over a prefill and 32 greedy decode steps (float32 tolerance) with the
same greedy tokens; speculative output equals target-only output (greedy, and seeded
under the coupled rule on the float path), drafts proposed and accepted, on the float
and the quantized-block paths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from specserve.engine.config import ModelConfig
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.errors import ModelLoadError
from specserve.engine.loader import load_model, read_config
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.quant import QuantizedWeight
from specserve.engine.sampling import SamplingParams, SamplingRule
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.tp import check_divisible
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy
from tests.support.hf_families import family_config, family_reference, write_family_gguf
from tests.support.hf_tiny import PROMPT
from tests.support.tiny import noisy_copy

FAMILIES = ["qwen3", "granite", "olmo2", "phi3", "gemma2", "gemma3_text", "qwen3_moe", "mixtral"]
STEPS = 32
BUDGET = 8 << 20
# float32 rounding of the same sums in another order, over logits of size ~10
ATOL = 1e-4


class Family:
    """One family's reference model and the files written from it."""

    def __init__(self, model_type: str, root: Path) -> None:
        self.model_type = model_type
        self.ref = family_reference(model_type)
        self.hf_dir = root / "hf"
        self.ref.save_pretrained(self.hf_dir)
        self.gguf_f16 = root / "f16.gguf"
        write_family_gguf(self.gguf_f16, model_type, self.ref, "F16")
        self.gguf_q8 = root / "q8_0.gguf"
        write_family_gguf(self.gguf_q8, model_type, self.ref, "Q8_0")
        with torch.no_grad():  # transformers' greedy continuation, teacher-forced below
            self.tokens = self.ref.generate(
                torch.tensor([PROMPT]), max_new_tokens=STEPS + 1, do_sample=False
            )[0, len(PROMPT) :].tolist()
            ids = torch.tensor([PROMPT + self.tokens[:STEPS]])
            self.logits = self.ref(ids).logits[0]  # [prompt + STEPS, vocab]


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp(request.param))


def greedy_logits(model: CausalLM, steps: int = STEPS) -> tuple[torch.Tensor, list[int]]:
    """The engine's logits of the prompt's positions and of ``steps`` greedy decode steps
    ``[len(PROMPT) + steps, vocab]``, and the ``steps + 1`` tokens it chose."""
    kv = model.new_kv_pool(BUDGET)
    kv.reserve({"s": len(PROMPT)})
    rows = [model([SeqInput("s", PROMPT, num_logits=len(PROMPT))], kv)]
    tokens = [int(rows[-1][-1].argmax())]
    for _ in range(steps):
        kv.reserve({"s": 1})
        rows.append(model([SeqInput("s", [tokens[-1]])], kv))
        tokens.append(int(rows[-1][-1].argmax()))
    return torch.cat(rows), tokens


def assert_matches_transformers(model: CausalLM, fam: Family) -> None:
    logits, tokens = greedy_logits(model)
    assert tokens == fam.tokens
    torch.testing.assert_close(logits, fam.logits, atol=ATOL, rtol=0)


def speculative_equals_target_only(target: CausalLM, draft: CausalLM, seeded: bool = False) -> None:
    """Speculative decoding with ``draft`` gives the target-only tokens, drafts proposed
    and accepted: greedy, or ``seeded`` sampling under the coupled rule."""
    engine = SpeculativeEngine(
        TargetVerifier(target, BUDGET), {"model": ModelDrafter(draft, BUDGET)}
    )
    prompts = [PROMPT, [9, 8, 7, 6, 5] * 3]

    def sampling(i: int) -> SamplingParams:
        if not seeded:
            return SamplingParams()
        return SamplingParams(0.7, top_k=40, top_p=0.95, seed=100 + i, rule=SamplingRule.COUPLED)

    def decode(drafter: str, k: int) -> list[DecodeState]:
        states = [
            DecodeState(f"s{i}", p, sampling(i), StopCriteria(max_new_tokens=STEPS),
                        KPolicy(k), drafter=drafter)
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        engine.run(states)
        return states

    plain, spec = decode("none", 0), decode("model", 4)
    assert [s.completion for s in spec] == [p.completion for p in plain]
    assert sum(s.stats.drafted for s in spec) > 0
    assert sum(s.stats.accepted for s in spec) > 0


def test_hf_directory_matches_transformers(fam: Family) -> None:
    model, cfg = load_model(fam.hf_dir, torch.float32, huge_pages=False)
    assert cfg.model_type == fam.model_type
    assert_matches_transformers(model, fam)


def test_gguf_float_matches_transformers(fam: Family) -> None:
    model, cfg = load_model(fam.gguf_f16, torch.float32, huge_pages=False)
    hf_cfg = read_config(fam.hf_dir)
    same = ("qk_norm", "norm_layout", "sliding_window", "sliding_layers", "head_dim",
            "attention_bias", "hidden_act", "local_rope_theta", "rope_theta")  # fmt: skip
    for name in same:
        assert getattr(cfg, name) == getattr(hf_cfg, name), name
    close = ("embedding_multiplier", "residual_multiplier", "logits_scaling")
    for name in (*close, "final_logit_softcapping"):
        assert getattr(cfg, name) == pytest.approx(getattr(hf_cfg, name)), name

    def softmax_scale(c: ModelConfig) -> float:
        return c.head_dim**-0.5 if c.attention_multiplier is None else c.attention_multiplier

    assert softmax_scale(cfg) == pytest.approx(softmax_scale(hf_cfg))
    assert_matches_transformers(model, fam)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_speculative_equals_target_only(fam: Family, seeded: bool) -> None:
    target, _ = load_model(fam.hf_dir, torch.float32, huge_pages=False)
    speculative_equals_target_only(target, noisy_copy(target, noise=0.3, seed=7), seeded)


def test_gguf_blocks_keep_blocks_and_speculate_exactly(fam: Family) -> None:
    """Q8_0 matrices stay blocks (the same integer products as the shipped pair; every
    expert's three, sliced from llama.cpp's stacked experts); their logits are those of
    the dequantized file up to the 8-bit activation rounding, and speculation over them
    is exact."""
    quantized, cfg = load_model(fam.gguf_q8, weights="quantized", huge_pages=False)
    dequantized, _ = load_model(fam.gguf_q8, weights="dequantized", huge_pages=False)
    layer = quantized.model.layers[0]
    router = getattr(layer.mlp, "gate", None)  # a mixture's router: float, not a projection
    projections = [m for m in layer.modules() if isinstance(m, nn.Linear) and m is not router]
    weights = [m.weight for m in projections]
    assert len(weights) == 4 + 3 * max(cfg.num_experts, 1)
    assert all(isinstance(w, QuantizedWeight) for w in weights)
    q_logits, _ = greedy_logits(quantized, steps=4)
    d_logits, _ = greedy_logits(dequantized, steps=4)
    assert (q_logits - d_logits).abs().max() < 0.05 * d_logits.abs().max()
    speculative_equals_target_only(quantized, noisy_copy(dequantized, noise=0.3, seed=7))


def test_settings_the_decoder_does_not_run_are_refused() -> None:
    phi3 = family_config("phi3").to_dict()
    phi3["rope_parameters"] = {**phi3["rope_parameters"], "partial_rotary_factor": 0.75}
    with pytest.raises(ModelLoadError, match=r"partial rotary embeddings .* not supported"):
        ModelConfig.from_hf(phi3)
    granite = {**family_config("granite").to_dict(), "mlp_bias": True}
    with pytest.raises(ModelLoadError, match=r"MLP biases"):
        ModelConfig.from_hf(granite)
    gemma = {**family_config("gemma2").to_dict(), "attn_logit_softcapping": -1.0}
    with pytest.raises(ModelLoadError, match=r"attn_logit_softcapping must be positive"):
        ModelConfig.from_hf(gemma)


def test_gemma2_attention_scores_pass_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Gemma 2's causal attention scores go well past its soft-cap, so the
    parity tests above exercise the cap (transformers' eager attention, recorded)."""
    import transformers.models.gemma2.modeling_gemma2 as g2

    peaks: list[float] = []
    original = g2.eager_attention_forward

    def recording(
        module: nn.Module, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        keys = g2.repeat_kv(key, module.num_key_value_groups)
        scores = (query @ keys.transpose(2, 3)) * kwargs["scaling"]
        peaks.append(float(scores.tril().abs().max()))  # the keys a query may see
        return original(module, query, key, *args, **kwargs)

    monkeypatch.setattr(g2, "eager_attention_forward", recording)
    ref = family_reference("gemma2")
    with torch.no_grad():
        ref(torch.tensor([PROMPT]))
    cap = ref.config.attn_logit_softcapping
    assert len(peaks) == ref.config.num_hidden_layers
    assert max(peaks) > 2 * cap, (peaks, cap)
    assert ModelConfig.from_hf(ref.config.to_dict()).attn_logit_softcapping == cap


def test_gemma2_capped_rows_have_the_bits_of_one_token_steps(tmp_path: Path) -> None:
    """Batch invariance with the cap: a session's 5 verify rows, among another session's
    rows, have the bits of its 5 one-token steps (the CPU kernel's capped scores), and
    are within float32 rounding of the torch path's (explicit capped attention)."""
    from specserve.engine import cpu_kernels, ops

    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels do not build here")
    family_reference("gemma2").save_pretrained(tmp_path)
    model, cfg = load_model(tmp_path, torch.float32, huge_pages=False)
    assert cfg.attn_logit_softcapping == 2.0 and not cfg.plain_layers
    new = [40, 41, 42, 43, 44]

    def run(kernels: bool, one_by_one: bool) -> torch.Tensor:
        kv = model.new_kv_pool(BUDGET)
        kv.reserve({"a": len(PROMPT) + 5, "b": len(PROMPT) + 5})
        with ops.kernels_enabled(kernels):
            model([SeqInput("a", PROMPT, 0), SeqInput("b", PROMPT[::-1], 0)], kv)
            if one_by_one:
                return torch.cat([model([SeqInput("a", [t])], kv) for t in new])
            both = [SeqInput("b", [7, 8, 9], 3), SeqInput("a", new, len(new))]
            return model(both, kv)[3:]

    verify, steps, torch_path = run(True, False), run(True, True), run(False, False)
    assert torch.equal(verify, steps)
    assert (verify - torch_path).abs().max() <= 1e-4 * torch_path.abs().max()


def test_olmo2_refuses_tensor_parallelism() -> None:
    """OLMo 2's q/k norm spans every head, which no rank holds whole."""
    cfg = ModelConfig.from_hf(family_config("olmo2").to_dict())
    with torch.device("meta"):
        model = CausalLM(cfg)
    check_divisible(model, 1)
    with pytest.raises(ModelLoadError, match=r"cannot split olmo2 over 2 .* q/k norm spans"):
        check_divisible(model, 2)
