"""bench.quantized_report on known figures: the headline's ratios and #25's targets.

The llama.cpp side's figures are made up here (no build needed), so the page and the
headline that the real run writes are checked on numbers whose ratios are known.
"""

from __future__ import annotations

import argparse

import pytest

from bench.common import environment
from bench.llama_cpp import BenchFigure, BenchRun, SpeculativeRun
from bench.quantized import Prompt, Variant
from bench.quantized_report import markdown, summarize

ARGS = argparse.Namespace(
    target="target.gguf", draft="draft.gguf", target_dtype="float32", draft_dtype="bfloat16",
    prompts="0-0", prose=0, new_tokens=128, ks="auto", draft_max=8, pp=128, bench_reps=3,
    curve_rows="1-2", threads=2, llama_cpp=None, llama_ctx=4096, tiny=False, name="q",
    no_write=True,
)  # fmt: skip
GIB = 1 << 30


def _bench(target_tg: float) -> dict[str, BenchRun]:
    def run(pp: float, tg: float) -> BenchRun:
        figures = {
            "pp128": BenchFigure("pp128", pp, 0.0, []),
            "tg128": BenchFigure("tg128", tg, 0.0, []),
        }
        return BenchRun(figures, GIB, {"cpu_info": "a CPU"})

    return {"target": run(50.0, target_tg), "draft": run(200.0, 40.0)}


def _result(target_only_decode_s: float) -> dict:
    target_only = Variant(
        "specserve target-only", "none", 0, seconds=[10.0], tokens=[[0] * 128],
        decode_seconds=[target_only_decode_s], decode_tokens=[120],
    )  # fmt: skip
    spec = Variant(
        "specserve speculative k=auto", "model", None, seconds=[5.0], tokens=[[0] * 128],
        decode_seconds=[4.0], decode_tokens=[120], drafted=100, accepted=80, rounds=30,
    )  # fmt: skip
    llama = {
        "skipped": None,
        "bench": [_bench(16.0), _bench(14.0)],  # tg 15.0 on average
        "speculative": [SpeculativeRun(57, 1.0, 130, 10.0, 150, 120, 2 * GIB)],
    }
    rss = {"before_load": GIB // 4, "target_loaded": GIB, "target_and_draft_loaded": 2 * GIB,
           "engine_built": 5 * GIB, "kv_budget": 3 * GIB, "peak": 5 * GIB}  # fmt: skip
    prompts = [Prompt("HumanEval/0", "def f():", [1, 2, 3])]
    return summarize(
        ARGS, prompts, [target_only, spec], llama, {"target": 100.0, "draft": 400.0},
        {1: 50.0, 2: 55.0}, rss, environment(),
    )  # fmt: skip


def test_the_headline_divides_by_llama_cpps_target_tg_and_judges_the_targets() -> None:
    result = _result(target_only_decode_s=8.0)  # 15 tok/s
    h = result["headline"]
    assert h["llama_tg_target_tokens_per_s"] == 15.0
    assert h["specserve_target_only_tokens_per_s"] == 15.0
    assert h["target_only_over_llama_tg"] == 1.0
    assert h["best_speculative"] == "specserve speculative k=auto"
    assert h["best_speculative_over_llama_tg"] == 2.0
    assert h["llama_speculative_tokens_per_s"] == 13.0
    assert h["best_speculative_over_llama_speculative"] == pytest.approx(30 / 13)
    assert h["prefill"]["specserve_over_llama"] == 2.0
    assert h["rss_bytes"]["llama_speculative_peak"] == 2 * GIB
    assert h["targets"] == {
        "target_only_over_llama_tg >= 1.0": True,
        "best_speculative_over_llama_tg >= 1.3": True,
    }
    assert result["specserve"]["variants"][1]["acceptance_rate"] == 0.8
    md = markdown(result)
    assert "-> **1.00x**" in md and "**2.00x** llama.cpp's target tg" in md
    assert "| llama-speculative (draft max 8) | 13.00 | – | 80.0% |" in md
    assert "| llama-bench target tg128 | 15.00 |" in md
    assert "| prefill target, 128 tokens (tok/s) | 100.0 | 50.0 |" in md
    assert "target target_only_over_llama_tg >= 1.0: met" in md
    assert "cpu_info a CPU" in md


def test_a_target_missed_reads_not_met() -> None:
    result = _result(target_only_decode_s=10.0)  # 12 tok/s: 0.8x llama.cpp's 15
    assert result["headline"]["target_only_over_llama_tg"] == pytest.approx(0.8)
    assert result["headline"]["targets"]["target_only_over_llama_tg >= 1.0"] is False
    md = markdown(result)
    assert "target target_only_over_llama_tg >= 1.0: **not met**" in md
    assert "target best_speculative_over_llama_tg >= 1.3: met" in md
