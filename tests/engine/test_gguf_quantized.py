"""GGUF read directly: block-quantized weights in the model, and the dequantized form.

The files are tiny decoders written by the test (:mod:`tests.support.tiny_gguf`) with
every block type the engine keeps (Q8_0, Q5_0, Q4_K, Q6_K) plus F16, F32 and Q4_0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from specserve.engine import ops
from specserve.engine.config import ModelConfig
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.errors import InvalidArgument, ModelLoadError
from specserve.engine.loader import load_model, load_tokenizer, read_config
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.quant import GGMLType, QuantizedWeight
from specserve.engine.quantized_layers import (
    QuantizedEmbedding,
    quantized_weights,
    set_quantized_weight,
)
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy
from tests.support.tiny_gguf import DRAFT_TYPES, write_tiny_gguf

PROMPT = [5, 17, 99, 3, 200, 7, 64, 1]


def logits(model: CausalLM, ids: list[int] = PROMPT) -> torch.Tensor:
    """Float32 logits of every position of ``ids`` in one prefill: [len(ids), vocab]."""
    kv = model.new_kv_pool(256 * model.config.kv_bytes_per_token)
    kv.reserve({"s": len(ids)})
    return model([SeqInput("s", ids, num_logits=len(ids))], kv)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A qwen2 file (untied, Q6_K head) and a llama file (tied, q/k rows interleaved)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {"qwen2": root / "tiny-qwen2.gguf", "llama": root / "tiny-llama.gguf"}
    write_tiny_gguf(out["qwen2"], arch="qwen2", seed=1)
    write_tiny_gguf(out["llama"], arch="llama", seed=2, head_type=None)
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_dequantized_form_equals_the_old_conversion(files: dict[str, Path], arch: str) -> None:
    """The dequantized form holds, bit for bit, the float32 model transformers makes of the
    file (what `models fetch` converted to safetensors before), config included."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = files[arch]
    model, cfg = load_model(path, weights="dequantized", huge_pages=False)
    assert cfg == ModelConfig.from_hf(load_gguf_checkpoint(str(path))["config"])
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    theirs = ref.state_dict()
    ours = dict(model.named_parameters())
    assert set(ours) <= set(theirs)
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name
    assert not any(quantized_weights(model))


def test_quantized_form_keeps_blocks(files: dict[str, Path]) -> None:
    model, cfg = load_model(files["qwen2"], huge_pages=False, weights="quantized")
    layer0, layer1 = (layer for layer in model.model.layers)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.model.embed_tokens.weight.ggml_type is GGMLType.Q4_K
    assert model.lm_head.weight.ggml_type is GGMLType.Q6_K
    kinds = {
        "q_proj": layer0.self_attn.q_proj.weight.ggml_type,
        "k_proj": layer0.self_attn.k_proj.weight.ggml_type,
        "v_proj": layer0.self_attn.v_proj.weight.ggml_type,
        "o_proj": layer0.self_attn.o_proj.weight.ggml_type,
    }
    assert kinds == {
        "q_proj": GGMLType.Q4_K,
        "k_proj": GGMLType.Q6_K,
        "v_proj": GGMLType.Q8_0,
        "o_proj": GGMLType.Q5_0,
    }
    # F16 and Q4_0 matrices are dequantized at load; norms and biases stay float32.
    assert isinstance(layer1.mlp.gate_proj.weight, nn.Parameter)
    assert isinstance(layer1.mlp.up_proj.weight, nn.Parameter)
    assert layer1.mlp.up_proj.weight.dtype == torch.float32
    assert model.dtype == torch.float32 and model.activation_dtype == torch.float32
    assert model.new_kv_pool(1 << 20).k[0].shape[1] == cfg.num_kv_heads


def test_tied_head_shares_the_embedding_blocks(files: dict[str, Path]) -> None:
    model, cfg = load_model(files["llama"], huge_pages=False, weights="quantized")
    assert cfg.tie_word_embeddings and cfg.model_type == "llama"
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_quantized_forward_is_close_to_the_dequantized_one(
    files: dict[str, Path], arch: str
) -> None:
    """With the integer kernels the quantized model's logits are the float32 model's on
    the dequantized weights up to the 8-bit activations' rounding (a 40-token prefill, same
    top-1 on most rows); with the kernels off a quantized product is the float32 product
    on the dequantized weight, bit for bit."""
    quantized, _ = load_model(files[arch], weights="quantized", huge_pages=False)
    dequantized, _ = load_model(files[arch], weights="dequantized", huge_pages=False)
    long_prompt = [(7 * i + 3) % 256 for i in range(40)]
    got, want = logits(quantized, long_prompt), logits(dequantized, long_prompt)
    assert ((got - want).abs().max() / want.std()) < 0.1
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
    with ops.kernels_enabled(False):
        assert torch.equal(logits(quantized), logits(dequantized))


def test_quantized_embedding_rows_are_rows_of_the_dequantized_table(
    files: dict[str, Path],
) -> None:
    quantized, _ = load_model(files["qwen2"], weights="quantized", huge_pages=False)
    dequantized, _ = load_model(files["qwen2"], weights="dequantized", huge_pages=False)
    ids = torch.tensor([0, 255, 17, 17, 3])
    table = dequantized.model.embed_tokens.weight
    assert torch.equal(quantized.model.embed_tokens(ids), table[ids])


@pytest.mark.parametrize("form", ["quantized", "dequantized"])
def test_greedy_speculative_equals_target_only(
    files: dict[str, Path], tmp_path: Path, form: str
) -> None:
    """A quantized (or dequantized) target verifying a Q5_0 draft commits target-only's
    tokens; drafts were proposed and accepted."""
    target, _ = load_model(files["qwen2"], weights=form, huge_pages=False)
    reference, _ = load_model(files["qwen2"], weights="dequantized", huge_pages=False)
    gen = torch.Generator().manual_seed(5)
    noisy = {
        name: p.detach() + 0.3 * p.detach().std() * torch.randn(p.shape, generator=gen)
        for name, p in reference.named_parameters()
    }
    draft_file = tmp_path / "draft.gguf"
    write_tiny_gguf(draft_file, types=DRAFT_TYPES, embed_type="Q8_0", head_type="Q8_0", base=noisy)
    draft, _ = load_model(draft_file, weights=form, huge_pages=False)
    budget = 8 << 20
    engine = SpeculativeEngine(
        TargetVerifier(target, budget), {"model": ModelDrafter(draft, budget)}
    )
    prompts = [[(11 * i + 5 * j) % 256 for i in range(6 + 2 * j)] * 2 for j in range(3)]

    def run(drafter: str, k: int | None) -> list[DecodeState]:
        states = [
            DecodeState(
                f"{drafter}{i}",
                p,
                SamplingParams(),
                StopCriteria(max_new_tokens=16),
                KPolicy(k),
                drafter=drafter,
            )
            for i, p in enumerate(prompts)
        ]
        engine.run(states)
        return states

    plain = run("none", 0)
    for k in (3, None):
        spec = run("model", k)
        assert [s.completion for s in spec] == [p.completion for p in plain], k
        assert sum(s.stats.drafted for s in spec) > 0
        assert sum(s.stats.accepted for s in spec) > 0


def test_tokenizer_and_config_from_the_file(files: dict[str, Path]) -> None:
    tok = load_tokenizer(files["qwen2"])
    assert 255 in tok.eos_token_ids
    assert tok.decode(tok.encode("abc")) == "abc"
    assert read_config(files["qwen2"]).hidden_size == 256


def test_unknown_weight_form(files: dict[str, Path]) -> None:
    with pytest.raises(InvalidArgument, match=r"weights 'int4' is not one of quantized, dequant"):
        load_model(files["qwen2"], weights="int4")


def test_tensor_past_the_end_is_a_clear_error(files: dict[str, Path], tmp_path: Path) -> None:
    data = files["qwen2"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError, match=r"cut.gguf is truncated or corrupt .*past the end"):
        load_model(cut)
    cut.write_bytes(data[:300])
    with pytest.raises(ModelLoadError, match=r"is truncated or corrupt"):
        load_model(cut)


def test_shape_that_does_not_fit_the_config(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path)
    # The same tensors under a config with a wider MLP: ffn_* no longer fit.
    reader = gguf.GGUFReader(str(path))
    offset = reader.fields["qwen2.feed_forward_length"].parts[-1]
    assert int(offset[0]) == 512
    raw = bytearray(path.read_bytes())
    start = reader.fields["qwen2.feed_forward_length"].offset
    idx = raw.index((512).to_bytes(4, "little"), start)
    raw[idx : idx + 4] = (1024).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_gate\.weight of bad.gguf has shape"):
        load_model(path)


def test_quantized_tensor_parallel_shards_sum_to_the_full_product() -> None:
    """Column shards are rows of blocks, row shards whole blocks of every row, and a row
    split inside a block falls back to the dequantized float32 slice."""
    from specserve.engine.tp import _shard_linear

    gen = torch.Generator().manual_seed(0)
    for in_features, expect_blocks in ((128, True), (96, False)):  # Q8_0: 4 / 3 blocks a row
        blocks = torch.randint(
            0, 256, (8, in_features // 32 * 34), dtype=torch.uint8, generator=gen
        )
        blocks.view(8, -1, 34)[:, :, 0:2] = torch.tensor([0.01], dtype=torch.float16).view(
            torch.uint8
        )
        weight = QuantizedWeight(GGMLType.Q8_0, (8, in_features), blocks)
        x = torch.randn(3, in_features, generator=gen)
        # a row split inside a block: float32 slices, against the float32 product
        full = ops.linear(x, weight) if expect_blocks else x @ weight.dequantize().T
        parts = []
        for rank in range(2):
            proj = nn.Linear(in_features, 8, bias=False)
            set_quantized_weight(proj, weight)
            _shard_linear(proj, 1, rank, 2)
            assert isinstance(proj.weight, QuantizedWeight) == expect_blocks
            assert (proj.out_features, proj.in_features) == (8, in_features // 2)
            parts.append(
                ops.linear(x[:, rank * in_features // 2 :][:, : in_features // 2], proj.weight)
            )
        # whole activation blocks on each rank: the same 8-bit values, summed in two parts
        torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-5)
        rows = []
        for rank in range(2):
            proj = nn.Linear(in_features, 8, bias=False)
            set_quantized_weight(proj, weight)
            _shard_linear(proj, 0, rank, 2)
            assert isinstance(proj.weight, QuantizedWeight)
            rows.append(ops.linear(x, proj.weight))
        assert torch.equal(torch.cat(rows, dim=1), ops.linear(x, weight))


def test_spec_names_the_weight_form(files: dict[str, Path]) -> None:
    from specserve.engine.loader import load_spec
    from specserve.engine.model_spec import ModelSpec, WeightForm

    plain = ModelSpec.parse("qwen2.5-coder-1.5b-instruct")
    assert plain.weights is None and plain.source == plain.text  # the device's default
    spec = ModelSpec.parse(f"{files['qwen2']}:weights=dequantized")
    assert spec.weights is WeightForm.DEQUANTIZED and spec.source == str(files["qwen2"])
    with pytest.raises(InvalidArgument, match=r"weights 'fp8' is not one of quantized"):
        ModelSpec.parse("model.gguf:weights=fp8")
    with pytest.raises(InvalidArgument, match=r"names a weight form but no model"):
        ModelSpec.parse(":weights=quantized")
    loaded = load_spec(spec, "float32", locate=Path, huge_pages=False, tokenizer=False)
    assert not any(quantized_weights(loaded.model))
    # On huge pages (where the kernel offers them) the blocks move and compute the same.
    quantized = f"{files['qwen2']}:weights=quantized"
    loaded = load_spec(quantized, "float32", locate=Path, tokenizer=False)
    assert any(quantized_weights(loaded.model))
    unmoved, _ = load_model(files["qwen2"], huge_pages=False, weights="quantized")
    assert torch.equal(logits(loaded.model), logits(unmoved))


def test_a_gguf_file_loads_quantized_by_default_where_the_kernels_read_blocks(
    files: dict[str, Path],
) -> None:
    """No form named: blocks on a CPU with the kernels, dequantized on other devices and
    on a CPU without them (where every product would dequantize its matrix again)."""
    from specserve.engine import cpu_kernels
    from specserve.engine.gguf_weights import default_weight_form
    from specserve.engine.model_spec import DEFAULT_WEIGHT_FORM, WeightForm

    assert DEFAULT_WEIGHT_FORM is WeightForm.QUANTIZED
    assert default_weight_form(torch.device("meta")) is WeightForm.DEQUANTIZED
    has_kernels = cpu_kernels.kernels() is not None
    model, _ = load_model(files["qwen2"], huge_pages=False)
    assert any(quantized_weights(model)) is has_kernels
    if has_kernels:
        assert default_weight_form(torch.device("cpu")) is WeightForm.QUANTIZED
        dequantized, _ = load_model(files["qwen2"], huge_pages=False, weights="dequantized")
        got, want = logits(model), logits(dequantized)  # the integer kernels: close
        assert not torch.equal(got, want) and (got - want).abs().max() < 0.1 * want.std()
