"""bench.engine_decode's own code on a tiny transformers checkpoint (no real weights).

The benchmark loads the engine over transformers' weight tensors, decodes prompts
greedily with both, times forwards of every token count and the matrix products
alone, and reports it all. Only the prompts (HumanEval, the real tokenizer), the
bandwidth meter and the real model stay out: the rest runs here as ``main`` runs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import engine_decode
from bench.common import Samples, _jsonable, environment
from bench.engine_decode_measure import (
    FORWARD_SIZES,
    decode_prompts,
    forward_costs,
    page_size_ab,
)
from bench.engine_decode_models import ENGINE, HF, Models, load_models, weight_bytes_per_token
from bench.engine_decode_report import Measured, plot, relative, report
from tests.support.hf_tiny import PROMPT, save_hf_dir

NEW_TOKENS = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    save_hf_dir("qwen2", path)
    return load_models(path, huge_pages=False)


def test_the_command_line_parses_to_the_documented_defaults() -> None:
    args = engine_decode.parser().parse_args([])
    assert (args.model, args.prompts, args.new_tokens) == ("qwen2.5-coder-1.5b-instruct", 10, 128)
    assert (args.context, args.reps, args.name) == (200, 9, "engine_decode")
    assert engine_decode.parser().parse_args(["--no-huge-pages"]).no_huge_pages


def test_a_tiny_run_measures_and_reports_every_variant(models: Models, tmp_path: Path) -> None:
    engine = models.engine
    assert list(models.transformers) == [HF] and models.moved_bytes == 0
    # The engine runs over transformers' tensors, not a copy of them.
    hf_params = {p.data_ptr() for p in models.transformers[HF].parameters()}
    assert all(p.data_ptr() in hf_params for p in engine.parameters())
    embed = engine.model.embed_tokens.weight
    expected = sum(p.numel() * 4 for p in engine.parameters()) - embed.numel() * 4
    assert weight_bytes_per_token(engine) == expected  # untied head: the table is not read

    done: list[int] = []
    prompts = [PROMPT, PROMPT[::-1]]
    runs = decode_prompts(models, prompts, NEW_TOKENS, lambda i, _: done.append(i))
    assert done == [0, 1] and list(runs) == [ENGINE, HF]
    for decodes in runs.values():
        assert len(decodes) == len(prompts)
        for d in decodes:
            assert len(d.tokens) == NEW_TOKENS and len(d.steps_s) == NEW_TOKENS - 1
            assert d.prefill_s > 0 and d.per_token_s > 0
    assert [d.tokens for d in runs[ENGINE]] == [d.tokens for d in runs[HF]]  # greedy agrees

    costs = forward_costs(models, list(range(3, 19)), reps=1)
    assert set(costs) == {ENGINE, f"{ENGINE}-torch", HF, "products", "products-torch"}
    assert all(set(by_n) == set(FORWARD_SIZES) for by_n in costs.values())
    pages, page_bytes = page_size_ab(engine, reps=1)
    assert set(pages) == {"huge pages", "4 KiB pages"} and page_bytes > 0

    rel = relative(costs)
    assert all(by_n[1] == 1.0 for by_n in rel.values())
    png = tmp_path / "engine_decode.png"
    assert plot(rel, png) and png.stat().st_size > 0
    argv = ["--prompts", "2", "--new-tokens", str(NEW_TOKENS), "--context", "16", "--reps", "1"]
    args = engine_decode.parser().parse_args(argv)
    measured = Measured(
        model="tiny-qwen2",
        huge_pages=False,
        moved_bytes=0,
        floor_bytes=weight_bytes_per_token(engine),
        bandwidth=Samples([1.0e10, 1.2e10, 0.8e10]),
        bandwidth_4k=Samples([0.6e10]),
        runs=runs,
        costs=costs,
        pages=pages,
        page_bytes=page_bytes,
        load_before=None,
        load_after=(0.5, 0.4, 0.3),
        others=0.1,
    )
    md, data = report(measured, args, environment(), "reproduce-me", png.name)
    assert md.startswith("# Engine decode: target-only speed, memory floor, transformers")
    assert "## Decode: HumanEval 0-1, raw prompt, 4 new tokens each" in md
    for name in costs:
        assert f"\n| {name} | " in md  # a row of the forward-cost table
    assert "greedy tokens identical to the engine's: transformers: 2 of 2 prompts." in md
    assert "Streaming read bandwidth **10.0 GB/s**" in md
    assert "![forward cost](engine_decode.png)" in md
    assert "## Weights on huge pages vs 4 KiB pages" in md and "reproduce-me" in md
    assert data["first_diff"] == {HF: [None, None]}
    assert data["args"]["reps"] == 1 and set(data["decode"]) == {ENGINE, HF}
    assert json.loads(json.dumps(data, default=_jsonable))["page_size"]["bytes"] == page_bytes
