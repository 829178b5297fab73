"""A decoder whose projections are quantized: with the integer kernels, a verify forward
gives every row the bits of one-token steps (batch invariance, the exactness contract)
and every forward stays close to the float32 decoder holding the dequantized matrices
(8-bit activations); without the kernels it computes that float32 decoder's bits."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from specserve.engine import cpu_kernels, ops, tiled_products
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.quant import GGMLType, QuantizedWeight
from specserve.engine.quant.synthetic import random_weight
from specserve.engine.tiny import tiny_config

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantized_pair(seed: int) -> tuple[CausalLM, CausalLM]:
    """(a model with every projection quantized, cycling through the types; its float32
    twin holding the dequantized matrices). Hidden 256 so that every type fits."""
    torch.manual_seed(seed)
    cfg = tiny_config(hidden_size=256, intermediate_size=512, head_dim=64)
    quantized = CausalLM(cfg).eval()
    wide = copy.deepcopy(quantized)
    types = itertools.cycle(GGMLType)
    for n, (layer, twin) in enumerate(zip(quantized.model.layers, wide.model.layers, strict=True)):
        for name in _PROJECTIONS:
            parent = (
                layer.self_attn
                if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                else layer.mlp
            )
            twin_parent = twin.self_attn if parent is layer.self_attn else twin.mlp
            module, twin_module = getattr(parent, name), getattr(twin_parent, name)
            out, k = module.weight.shape
            w = random_weight(next(types), out, k, seed=100 * n + len(name), scales=(1e-5, 2e-3))
            del module.weight  # a plain attribute from now on: the model reads .weight
            module.weight = w
            twin_module.weight = nn.Parameter(w.dequantize(), requires_grad=False)
    return quantized, wide


def _run(model: CausalLM, ids: list[int], kernels: bool) -> list[torch.Tensor]:
    kv = model.new_kv_pool(1 << 22)
    kv.reserve({"a": 60, "b": 60, "c": 60})
    with torch.no_grad():
        many = model([SeqInput("a", ids[:40], num_logits=40)], kv)  # > 32 rows
        few = model([SeqInput("b", ids[:20], num_logits=20)], kv)
        verify = model([SeqInput("b", ids[20:25], num_logits=5)], kv)
        model([SeqInput("c", ids[:20], num_logits=1)], kv)
        steps = torch.cat([model([SeqInput("c", [i])], kv) for i in ids[20:25]])
    if kernels:  # a verify forward equals one-token steps (the torch path: to rounding)
        assert torch.equal(verify, steps)
    return [many, few, verify, steps]


@pytest.mark.parametrize("tiles", ["one", "several"])
def test_without_the_kernels_a_quantized_model_is_its_dequantized_float32_twin(
    tiles: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tiles``: a prefill's products in one tile per matrix (the default size at these
    shapes) or in tiles of 64 rows (32 for down_proj), as real-size matrices are."""
    if tiles == "several":
        monkeypatch.setattr(tiled_products, "TILE_FLOATS", 64 * 256)
    quantized, wide = _quantized_pair(seed=3)
    assert isinstance(quantized.model.layers[0].self_attn.q_proj.weight, QuantizedWeight)
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    with ops.kernels_enabled(False):
        got, want = _run(quantized, ids, False), _run(wide, ids, False)
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_with_the_kernels_verify_rows_are_steps_and_close_to_the_float32_twin() -> None:
    """Verify == steps bit for bit (asserted in _run); prefills of 20 and 40 rows, verify
    and steps within the 8-bit activations' rounding of the float32 twin, top-1 mostly
    the same."""
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels are not available here")
    quantized, wide = _quantized_pair(seed=3)
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    got, want = _run(quantized, ids, True), _run(wide, ids, True)
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all() and not torch.equal(a, b)
        err = (a - b).abs().max() / b.std()
        assert err < 0.1, float(err)
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


def test_a_prompt_with_drafts_appended_is_the_prompt_then_steps() -> None:
    """Batch invariance past the kernels' 32 rows: a 45-token prompt with 5 drafts
    appended in one call (a speculative first round: 6 logit rows) gives the last prompt
    token the logits of the prompt alone (target-only's first round: 1 logit row) and
    the drafts' rows the bits of one-token steps, so its KV cache and every later token
    are target-only's."""
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels are not available here")
    quantized, _ = _quantized_pair(seed=5)
    head = quantized.lm_head  # quantized too, as a GGUF model's head is
    del head.weight
    head.weight = random_weight(GGMLType.Q6_K, 256, 256, seed=7, scales=(1e-5, 2e-3))
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(6)).tolist()
    kv = quantized.new_kv_pool(1 << 22)
    kv.reserve({"alone": 60, "together": 60})
    with torch.no_grad():
        alone = quantized([SeqInput("alone", ids[:45], num_logits=1)], kv)
        steps = torch.cat([quantized([SeqInput("alone", [i])], kv) for i in ids[45:]])
        together = quantized([SeqInput("together", ids, num_logits=6)], kv)
        after = [quantized([SeqInput(s, [7])], kv) for s in ("alone", "together")]
    assert torch.equal(together[:1], alone) and torch.equal(together[1:], steps[:5])
    assert torch.equal(after[0], after[1])


def test_a_long_forward_without_logits_caches_every_token() -> None:
    """A prefill past 32 rows that asks for no logits (a Prefill call) still runs (its
    last chunk in the batch's forward) and caches every token: the next step equals the
    one after a prefill asking for the last token's logits."""
    quantized, _ = _quantized_pair(seed=8)
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(9)).tolist()
    kv = quantized.new_kv_pool(1 << 22)
    kv.reserve({"none": 80, "one": 80})
    with torch.no_grad():
        assert quantized([SeqInput("none", ids, num_logits=0)], kv).shape[0] == 0
        quantized([SeqInput("one", ids, num_logits=1)], kv)
        after = [quantized([SeqInput(s, [3])], kv) for s in ("none", "one")]
    assert kv.length("none") == kv.length("one") == 71
    assert torch.allclose(after[0], after[1], rtol=1e-4, atol=1e-4)


def test_a_layer_as_one_op_gives_the_bits_of_its_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels, each decoder layer of quantized weights runs as one op
    (``decoder_layer``); its logits and KV cache are those of the modules' own forwards
    (forced by a forward hook on each attention module, as tensor parallelism adds),
    for a prefill of a few rows, a ragged batch of two sessions and one-token steps."""
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels are not available here")
    from specserve.engine import layers as layers_module

    calls = [0]
    run_layer = layers_module.run_layer

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls[0] += 1
        return run_layer(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(layers_module, "run_layer", counted)
    fused, _ = _quantized_pair(seed=11)
    modules = copy.deepcopy(fused)
    for layer in modules.model.layers:
        layer.self_attn.register_forward_hook(lambda _m, _i, out: out)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(12)).tolist()

    def run(model: CausalLM) -> list[torch.Tensor]:
        kv = model.new_kv_pool(1 << 22)
        kv.reserve({"a": 40, "b": 40})
        with torch.no_grad():
            out = [model([SeqInput("a", ids[:9], num_logits=9)], kv)]
            out.append(model([SeqInput("a", ids[9:12], 3), SeqInput("b", ids[:5], 2)], kv))
            out += [model([SeqInput("b", [i])], kv) for i in ids[5:8]]
        return [*out, kv.k[0][: kv.block_size * 4], kv.v[-1][: kv.block_size * 4]]

    got = run(fused)
    assert calls[0] == 5 * fused.config.num_layers  # every forward, every layer
    want = run(modules)
    assert calls[0] == 5 * fused.config.num_layers  # a hooked layer runs its modules
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    # A weight replaced after the first forward is packed again, not served stale.
    layer = fused.model.layers[0]
    before = layer._packed
    out, k = layer.self_attn.o_proj.weight.shape
    replaced = random_weight(GGMLType.Q8_0, out, k, seed=99, scales=(1e-5, 2e-3))
    layer.self_attn.o_proj.weight = replaced
    kern = cpu_kernels.kernels()
    assert kern is not None and layer._packed_layer(kern) is not before
    assert layer._packed is not None and layer._packed.sources[3] is replaced
