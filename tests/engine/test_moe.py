"""The mixture-of-experts feed-forward's batch invariance, and what MoE configs are refused.

Parity with transformers, GGUF loading and speculative exactness are in
tests/engine/test_families.py (``qwen3_moe``, ``mixtral``). Here: a row's output has the
same bits alone as among other rows that chose other experts, for the MoE module
and for the whole model's verify step, on float weights and on Q8_0 blocks; the test
asserts the rows' experts differ, so it cannot pass with every row on the same
experts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specserve.engine.config import ModelConfig
from specserve.engine.errors import ModelLoadError
from specserve.engine.loader import load_model
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.moe import MoE, route
from specserve.engine.ops import linear
from specserve.engine.tp import check_divisible
from tests.support.hf_families import family_config, family_reference, write_family_gguf
from tests.support.hf_tiny import PROMPT

MOE_FAMILIES = ["qwen3_moe", "mixtral"]
BUDGET = 8 << 20
ROWS = 5  # a verify of k = 4 drafts


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_files(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """The family's tiny model as a Hugging Face directory and a Q8_0 GGUF file."""
    root = tmp_path_factory.mktemp(request.param)
    ref = family_reference(request.param)
    ref.save_pretrained(root / "hf")
    write_family_gguf(root / "q8.gguf", request.param, ref, "Q8_0")
    return root / "hf", root / "q8.gguf"


def chosen_experts(moe: MoE, x: torch.Tensor) -> list[tuple[int, ...]]:
    """Each row's experts (ascending) as the MoE routes ``x`` ``[rows, hidden]``."""
    _, experts = route(linear(x, moe.gate.weight), moe.top_k, moe.renormalize)
    return [tuple(sorted(row)) for row in experts.tolist()]


def test_moe_rows_have_their_bits_alone(moe_files: tuple[Path, Path]) -> None:
    model, _ = load_model(moe_files[0], torch.float32, huge_pages=False)
    moe = model.model.layers[0].mlp
    assert isinstance(moe, MoE)
    x = torch.randn(ROWS, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    assert len(set(chosen_experts(moe, x))) > 1, "every row chose the same experts"
    together = moe(x)
    for i in range(ROWS):
        assert torch.equal(moe(x[i : i + 1]), together[i : i + 1]), i


def routed_rows(model: CausalLM, run: Callable[[], object]) -> list[tuple[int, ...]]:
    """The experts the first layer chose for each row while ``run()`` ran."""
    seen: list[tuple[int, ...]] = []
    moe = model.model.layers[0].mlp

    def hook(_m: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen.extend(chosen_experts(moe, args[0]))

    handle = moe.register_forward_pre_hook(hook)
    try:
        run()
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("form", ["float", "q8_0"])
def test_verify_rows_equal_single_steps(moe_files: tuple[Path, Path], form: str) -> None:
    """A session's k + 1 verify rows, among another session's rows, have the bits of
    k + 1 one-token steps of that session alone; the rows' experts differ."""
    hf_dir, gguf = moe_files
    if form == "float":
        model, _ = load_model(hf_dir, torch.float32, huge_pages=False)
    else:
        model, _ = load_model(gguf, weights="quantized", huge_pages=False)
    drafts = [11, 42, 7, 200, 3]
    other = [9, 8, 7, 6, 5, 4]

    alone = model.new_kv_pool(BUDGET)
    alone.reserve({"s": len(PROMPT)})
    model([SeqInput("s", PROMPT)], alone)
    steps = []
    for t in drafts:
        alone.reserve({"s": 1})
        steps.append(model([SeqInput("s", [t])], alone))
    single = torch.cat(steps)  # [ROWS, vocab]

    batch = model.new_kv_pool(BUDGET)
    batch.reserve({"s": len(PROMPT), "o": len(other)})
    model([SeqInput("s", PROMPT), SeqInput("o", other)], batch)
    batch.reserve({"s": ROWS, "o": 2})
    seqs = [SeqInput("o", [1, 2], num_logits=2), SeqInput("s", drafts, num_logits=ROWS)]
    out: list[torch.Tensor] = []
    routes = routed_rows(model, lambda: out.append(model(seqs, batch)))
    assert len(set(routes[2:])) > 1, f"the session's rows chose the same experts: {routes}"
    assert torch.equal(out[0][2:], single)  # [ROWS, vocab]


def moe_config(**overrides: object) -> dict[str, object]:
    return {**family_config("qwen3_moe").to_dict(), **overrides}


def test_moe_configs_the_decoder_does_not_run_are_refused() -> None:
    with pytest.raises(ModelLoadError, match=r"dense MLP layers among the expert layers"):
        ModelConfig.from_hf(moe_config(mlp_only_layers=[1]))
    with pytest.raises(ModelLoadError, match=r"dense MLP layers among the expert layers"):
        ModelConfig.from_hf(moe_config(decoder_sparse_step=2))
    with pytest.raises(ModelLoadError, match=r"shared experts are not supported"):
        ModelConfig.from_hf(moe_config(shared_expert_intermediate_size=64))
    with pytest.raises(ModelLoadError, match=r"needs 1 to 4 experts per token \(got 5\)"):
        ModelConfig.from_hf(moe_config(num_experts_per_tok=5))


def test_router_settings_per_family() -> None:
    """Qwen3-MoE renormalizes as ``norm_topk_prob`` says; Mixtral always does."""
    assert not ModelConfig.from_hf(moe_config(norm_topk_prob=False)).norm_topk_prob
    mixtral = {**family_config("mixtral").to_dict(), "norm_topk_prob": False}
    cfg = ModelConfig.from_hf(mixtral)
    assert cfg.norm_topk_prob and cfg.num_experts == 4 and cfg.expert_intermediate_size == 128
    assert not cfg.plain_layers  # never the dense one-op layer


def test_tensor_parallelism_splits_each_expert_evenly() -> None:
    cfg = ModelConfig.from_hf(moe_config(moe_intermediate_size=48))
    with torch.device("meta"):
        model = CausalLM(cfg)
    check_divisible(model, 2)
    with pytest.raises(ModelLoadError, match=r"expert intermediate size \(48\)"):
        check_divisible(model, 32)
    with pytest.raises(ModelLoadError, match=r"TP sizes that fit this model: 1, 2$"):
        check_divisible(model, 4)
