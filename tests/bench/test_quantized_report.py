"""bench.quantized_report on known figures: the headline's ratios and issue 44's targets.

The llama.cpp side's figures are made up here (no build needed), so the page and the
headline that the real run writes are checked on numbers whose ratios are known; so are
the page's top line (CPU model and ISA, the AVX2 path forced on an AVX-512 CPU), the
repacking each llama.cpp figure ran with (a crash said, its figures the next-best),
and a page without the forward-cost curve.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from bench.common import environment
from bench.llama_cpp import REPACK_CRASHED, BenchFigure, BenchRun, SpeculativeRun
from bench.quantized import Prompt, Variant
from bench.quantized_page import markdown
from bench.quantized_report import summarize

ARGS = argparse.Namespace(
    target="target.gguf", draft="draft.gguf", target_dtype="float32", draft_dtype="bfloat16",
    prompts="0-0", prose=0, new_tokens=128, ks="auto", draft_max=8, pp=128, bench_reps=3,
    curve_rows=[1, 2], threads=2, llama_cpp=None, llama_ctx=4096, tiny=False, name="q",
    no_write=True, isa="native", llama_no_repack=False,
)  # fmt: skip
GIB = 1 << 30


def _bench(target_tg: float, repack: str = "on") -> dict[str, BenchRun]:
    def run(pp: float, tg: float) -> BenchRun:
        figures = {
            "pp128": BenchFigure("pp128", pp, 0.0, []),
            "tg128": BenchFigure("tg128", tg, 0.0, []),
        }
        return BenchRun(figures, GIB, {"cpu_info": "a CPU"}, repack)

    return {"target": run(50.0, target_tg), "draft": run(200.0, 40.0)}


def _result(
    target_only_decode_s: float,
    env: dict[str, Any] | None = None,
    repack: str = "on",
    crashed: dict[str, str] | None = None,
    curve: dict[int, float] | None = None,
) -> dict:
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
        "bench": [_bench(16.0, repack), _bench(14.0, repack)],  # tg 15.0 on average
        "speculative": [SpeculativeRun(57, 1.0, 130, 10.0, 150, 120, 2 * GIB, repack)],
        "build": "native",
        "repack_disabled": False,
        "repack_crashed": crashed or {},
        "forward_ms_by_rows": {1: 40.0, 2: 60.0},
    }
    rss = {"before_load": GIB // 4, "target_loaded": GIB, "target_and_draft_loaded": 2 * GIB,
           "engine_built": 5 * GIB, "kv_budget": 3 * GIB, "peak": 5 * GIB}  # fmt: skip
    prompts = [Prompt("HumanEval/0", "def f():", [1, 2, 3])]
    return summarize(
        ARGS, prompts, [target_only, spec], llama, {"target": 100.0, "draft": 400.0},
        {1: 50.0, 2: 55.0} if curve is None else curve, rss, env or environment(),
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
    assert h["adaptive_over_target_only"] == 2.0 and h["adaptive_over_llama_tg"] == 2.0
    assert h["adaptive_worst_prompt_over_target_only"] == {"code": 2.0, "prose": None}
    assert h["forward_rows_over_one"] == {"2": pytest.approx(1.1)}
    assert h["targets"] == {
        "target_only_over_llama_tg >= 1.05": False,  # 1.0x
        "adaptive_over_target_only >= 1.3": True,
        "adaptive_over_llama_tg >= 1.4": True,
        "adaptive_worst_prompt_over_target_only.code >= 1.0": True,
        "adaptive_worst_prompt_over_target_only.prose >= 1.0": None,  # no prose prompt
        "prefill_over_llama_pp >= 1.0": True,
        "forward_rows_over_one.5 <= 1.3": None,  # the curve ran 1 and 2 rows
        "forward_rows_over_one.9 <= 1.8": None,
    }
    assert result["specserve"]["variants"][1]["acceptance_rate"] == 0.8
    md = markdown(result)
    assert "-> **1.00x**" in md and "**2.00x** llama.cpp's target tg" in md
    assert "| llama-speculative (draft max 8) | 13.00 | – | 80.0% |" in md
    assert "| llama-bench target tg128 | 15.00 |" in md
    assert "| prefill target, 128 tokens (tok/s) | 100.0 | 50.0 |" in md
    assert "target target_only_over_llama_tg >= 1.05: **not met**" in md
    assert "target adaptive_over_target_only >= 1.3: met" in md
    assert "target forward_rows_over_one.5 <= 1.3: not measured" in md
    assert "- adaptive speculation: **2.00x** specserve target-only, 2.00x" in md
    assert "- target forward by new tokens, against one: 2 rows 1.10x" in md
    assert h["llama_forward_rows_over_one"] == {"2": pytest.approx(1.5)}
    assert "- llama.cpp's, same file and context: 2 rows 1.50x" in md
    assert "| specserve ms | 50.0 | 55.0 |" in md and "| llama.cpp ms | 40.0 | 60.0 |" in md
    assert "cpu_info a CPU" in md


def test_a_target_missed_reads_not_met() -> None:
    result = _result(target_only_decode_s=10.0, curve={1: 40.0, 5: 60.0, 9: 70.0})
    h = result["headline"]  # target-only 12 tok/s: 0.8x llama.cpp's 15
    assert h["target_only_over_llama_tg"] == pytest.approx(0.8)
    assert h["targets"]["target_only_over_llama_tg >= 1.05"] is False
    assert h["targets"]["forward_rows_over_one.5 <= 1.3"] is False  # 1.5x
    assert h["targets"]["forward_rows_over_one.9 <= 1.8"] is True  # 1.75x
    md = markdown(result)
    assert "target target_only_over_llama_tg >= 1.05: **not met**" in md
    assert "target adaptive_over_llama_tg >= 1.4: met" in md


def _avx512_env(**more: Any) -> dict[str, Any]:
    env = environment()
    env.update(
        cpu="Some Xeon", isa="avx512", isa_description="AVX-512 (F, BW, VNNI, BF16) + AMX",
        isa_measured="avx512", isa_forced=False, specserve_cpu_isa_env=None,
        specserve_kernels_isa="AVX512", torch_cpu_capability="AVX512",
    )  # fmt: skip
    env.update(more)
    return env


def test_the_page_opens_with_the_cpu_and_its_isa_and_the_headline_carries_it() -> None:
    result = _result(target_only_decode_s=8.0, env=_avx512_env())
    h = result["headline"]
    assert (h["cpu"], h["isa"], h["cpu_isa"], h["isa_forced"]) == (
        "Some Xeon", "avx512", "avx512", False,
    )  # fmt: skip
    md = markdown(result)
    assert md.split("\n")[2] == (
        "CPU: **Some Xeon, AVX-512 (F, BW, VNNI, BF16) + AMX** (ISA class avx512); specserve's "
        "kernels: AVX512; llama.cpp: scripts/build-llama-cpp.sh's native build (GGML_NATIVE: "
        "this machine's ISA)."
    )
    assert "forced" not in md


def test_the_avx2_path_forced_on_an_avx512_cpu_is_said_and_filed_as_avx2() -> None:
    env = _avx512_env(
        isa_measured="avx2", isa_forced=True, specserve_cpu_isa_env="AVX2",
        specserve_kernels_isa="AVX2",
    )  # fmt: skip
    result = _result(target_only_decode_s=8.0, env=env)
    result["llama_cpp"]["build"] = "avx2"
    assert result["headline"]["isa"] == "avx2" and result["headline"]["isa_forced"] is True
    assert result["headline"]["cpu_isa"] == "avx512"
    md = markdown(result)
    top = md.split("\n")[2]
    assert top.startswith("CPU: **Some Xeon, AVX-512 (F, BW, VNNI, BF16) + AMX**")
    assert "**AVX2 path forced on an AVX-512 CPU** (`--isa avx2`)" in top
    assert "SPECSERVE_CPU_ISA=AVX2" in top and "AVX2-only build (LLAMA_ISA=avx2" in top
    assert "- specserve kernels: AVX2 (forced by SPECSERVE_CPU_ISA)" in md


def test_every_llama_cpp_figure_names_its_repacking() -> None:
    md = markdown(_result(target_only_decode_s=8.0))
    on = "weights repacked (llama.cpp's default)"
    assert f"| llama-bench target tg128 | 15.00 | – | – | – | – | – | {on} |" in md
    assert f"| 8 | – | – | {on} |" in md  # llama-speculative's row
    assert f"| prefill target, 128 tokens (tok/s) | 100.0 | 50.0 | {on} |" in md
    assert "repacking crashed" not in md


def test_a_repacking_crash_is_said_and_its_figures_are_the_next_best() -> None:
    crashed = {"llama-bench target.gguf": "llama-bench exited -11 (SIGSEGV):\nSegmentation fault"}
    result = _result(target_only_decode_s=8.0, repack=REPACK_CRASHED, crashed=crashed)
    assert result["llama_cpp"]["repack_crashed"] == crashed
    assert result["headline"]["llama_tg_target_repack"] == REPACK_CRASHED
    md = markdown(result)
    assert (
        "**llama.cpp's weight repacking crashed**: llama-bench target.gguf (llama-bench "
        "exited -11 (SIGSEGV))" in md
    )
    assert "those figures are the next-best" in md
    label = "weights as stored: repacking crashed, next-best"
    assert f"| llama-bench target tg128 | 15.00 | – | – | – | – | – | {label} |" in md


def test_a_page_without_the_curve_says_it_was_skipped() -> None:
    result = _result(target_only_decode_s=8.0, curve={})
    assert result["specserve"]["forward_ms_by_rows"] == {}
    md = markdown(result)
    assert "Not measured: the curve was skipped (`--curve-rows ''`)." in md
    assert "| rows |" not in md
