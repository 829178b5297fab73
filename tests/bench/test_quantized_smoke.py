"""bench.quantized starts and reports without llama.cpp; its llama.cpp readers read.

The tiny run needs no llama.cpp build: it skips that side with a sentence and must
still find greedy speculative output equal to target-only, with drafts accepted. A
run on GGUF files whose llama.cpp binaries are missing stops with a sentence before
loading anything. The parsers read output in the tools' own formats (the printf
lines of llama-speculative, the JSON of ``llama-bench -o json``), and a child's peak
RSS is the child's.

``--curve-rows ''`` skips the curve end to end (the page says so), a bad list is a
usage error, and the results are filed under the ISA class measured
(quantized_avx512, quantized_avx2: ``--isa avx2`` forces the AVX2 path and files
there). The llama.cpp tools run with repacking on; a run that crashes with it runs once
more without it, and says so (fake tools here, no build).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import common, llama_cpp, quantized
from tests.support.tiny_gguf import DRAFT_TYPES, write_tiny_gguf


def test_a_tiny_run_skips_llama_cpp_and_checks_greedy_equality(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        *("--tiny", "--prompts", "0-0", "--prose", "1", "--new-tokens", "10"),
        *("--ks", "auto,3", "--bench-reps", "1", "--curve-rows", "1-2", "--pp", "16"),
        *("--threads", "1", "--no-write"),
    ]
    assert quantized.main(argv) == 0
    md = capsys.readouterr().out
    assert "**llama.cpp side skipped: the models are not GGUF files" in md
    assert "greedy speculative == target-only on every prompt: **yes**" in md
    accepted = int(md.split("**yes** (")[1].split(" drafts accepted")[0])
    assert accepted > 0
    assert "| specserve speculative k=3 |" in md and "| specserve speculative k=auto |" in md
    assert "target target_only_over_llama_tg >= 1.05: not measured" in md
    assert "| specserve ms | " in md  # the forward cost curve
    assert "| llama.cpp ms |" not in md  # no llama.cpp side


def test_gguf_models_without_llama_cpp_stop_with_a_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    write_tiny_gguf(target, seed=1)
    write_tiny_gguf(draft, seed=2, types=DRAFT_TYPES, embed_type="Q8_0", head_type="Q8_0")
    argv = [
        *("--target", f"{target}:weights=quantized", "--draft", f"{draft}:weights=quantized"),
        *("--llama-cpp", str(tmp_path / "nowhere"), "--no-write"),
    ]
    assert quantized.main(argv) == 2
    out = capsys.readouterr().out
    assert "llama.cpp is not built (llama-bench, llama-speculative missing" in out
    assert llama_cpp.BUILD_SCRIPT in out


def test_the_gguf_file_of_a_spec_is_located_and_tiny_models_have_none(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, seed=3)
    assert quantized.gguf_file(f"{path}:weights=quantized") == path
    assert quantized.gguf_file("tiny:3") is None


SPECULATIVE_LOG = """
main: the prompt and what followed ...

encoded   57 tokens in    1.012 seconds, speed:   56.324 t/s
decoded  135 tokens in    9.873 seconds, speed:   13.673 t/s

n_draft   = 8
n_predict = 135
n_drafted = 152
n_accept  = 116
accept    = 76.316%

draft:
"""


def test_llama_speculative_lines_give_its_figures() -> None:
    run = llama_cpp.parse_llama_speculative(SPECULATIVE_LOG, peak_rss_bytes=7)
    assert (run.prompt_tokens, run.tokens, run.drafted, run.accepted) == (57, 135, 152, 116)
    assert run.prefill_s == pytest.approx(1.012) and run.decode_s == pytest.approx(9.873)
    assert run.tokens_per_s == pytest.approx(135 / 9.873)
    assert run.acceptance_rate == pytest.approx(116 / 152)
    assert run.peak_rss_bytes == 7
    with pytest.raises(ValueError, match="lacks"):
        llama_cpp.parse_llama_speculative(SPECULATIVE_LOG.replace("n_accept", "n_other"))


def test_llama_bench_json_gives_pp_and_tg_by_test_name() -> None:
    rows = [
        {"n_prompt": 128, "n_gen": 0, "avg_ts": 55.5, "stddev_ts": 1.5, "samples_ts": [54, 57],
         "cpu_info": "some CPU", "build_commit": "abc", "n_threads": 2},
        {"n_prompt": 0, "n_gen": 128, "avg_ts": 15.9, "stddev_ts": 0.2, "samples_ts": [16, 15.8],
         "cpu_info": "some CPU", "build_commit": "abc", "n_threads": 2},
    ]  # fmt: skip
    figures, info = llama_cpp.parse_llama_bench(json.dumps(rows))
    assert figures["pp128"].tokens_per_s == 55.5 and figures["tg128"].tokens_per_s == 15.9
    assert figures["tg128"].samples == [16.0, 15.8]
    assert info == {"cpu_info": "some CPU", "build_commit": "abc", "n_threads": 2}
    with pytest.raises(ValueError, match="no test results"):
        llama_cpp.parse_llama_bench("[]")


def test_a_childs_peak_rss_is_measured_and_a_failure_reported() -> None:
    hold = "import time; time.sleep(0.3)"
    big = llama_cpp.run_measured([sys.executable, "-c", f"b = b'x' * (300 << 20); {hold}"])
    small = llama_cpp.run_measured([sys.executable, "-c", hold]).check()
    assert big.check().peak_rss_bytes > small.peak_rss_bytes + (250 << 20)
    # Only the child's own memory: this process's (torch loaded, and more here) is not in it.
    ballast = b"y" * (400 << 20)
    assert llama_cpp.run_measured([sys.executable, "-c", hold]).peak_rss_bytes < (200 << 20)
    del ballast
    failed = llama_cpp.run_measured([sys.executable, "-c", "import sys; sys.exit('no model')"])
    assert failed.returncode == 1
    with pytest.raises(RuntimeError, match="no model"):
        failed.check()


def test_a_tiny_run_without_the_curve_completes_and_is_filed_under_the_isa(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    written: dict[str, Any] = {}

    def write_results(name: str, md: str, data: dict[str, Any]) -> None:
        written.update(name=name, md=md, data=data)

    monkeypatch.setattr(common, "write_results", write_results)
    monkeypatch.setenv(quantized.ISA_ENV, "placeholder")  # restored after the test
    monkeypatch.delenv(quantized.ISA_ENV)  # no --isa, nothing in the environment: native
    argv = [
        *("--tiny", "--prompts", "0-0", "--prose", "0", "--new-tokens", "6"),
        *("--ks", "3", "--bench-reps", "1", "--curve-rows", "", "--pp", "8", "--threads", "1"),
    ]
    assert quantized.main(argv) == 0
    isa = common.isa_class()
    assert written["name"] == f"quantized_{isa}"
    data, md = written["data"], written["md"]
    assert data["specserve"]["forward_ms_by_rows"] == {}
    assert "Not measured: the curve was skipped (`--curve-rows ''`)." in md
    assert "| ms | " not in md
    assert data["headline"]["isa"] == isa and data["headline"]["isa_forced"] is False
    env = data["environment"]
    assert env["isa"] == env["isa_measured"] == isa and env["specserve_cpu_isa_env"] is None
    top = md.split("\n")[2]  # the line under the title: CPU model and ISA
    assert top.startswith(f"CPU: **{env['cpu']}, {env['isa_description']}** (ISA class {isa})")
    assert md in capsys.readouterr().out


def test_a_bad_curve_row_list_is_a_usage_error_before_anything_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for bad in ("1-x", "3-1", "1,,2"):
        with pytest.raises(SystemExit) as stop:
            quantized.main(["--tiny", "--curve-rows", bad, "--no-write"])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert "argument --curve-rows:" in err and repr(bad) in err
    with pytest.raises(SystemExit):
        quantized.main(["--tiny", "--prompts", "a-b", "--no-write"])
    assert "argument --prompts:" in capsys.readouterr().err


def test_the_default_result_name_is_the_isa_class_measured() -> None:
    assert quantized.default_name(quantized.measured_isa("native", "avx512")) == (
        "quantized_avx512"
    )
    assert quantized.default_name(quantized.measured_isa("native", "avx2")) == "quantized_avx2"
    # The AVX2 path forced on an AVX-512 CPU is filed with the AVX2 machines.
    assert quantized.default_name(quantized.measured_isa("avx2", "avx512")) == "quantized_avx2"
    assert quantized.default_name(quantized.measured_isa("avx2", "avx2")) == "quantized_avx2"
    with pytest.raises(ValueError, match="no AVX2"):
        quantized.measured_isa("avx2", "baseline")


def test_isa_sets_or_clears_the_kernels_variable_and_the_environment_decides_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(quantized.ISA_ENV, "AVX2")  # restored after the test
    assert quantized.apply_isa(None) == ("avx2", "AVX2")  # left as it was
    assert quantized.apply_isa("native") == ("native", None)
    assert quantized.ISA_ENV not in os.environ
    assert quantized.apply_isa(None) == ("native", None)
    assert quantized.apply_isa("avx2") == ("avx2", "AVX2")
    assert os.environ[quantized.ISA_ENV] == "AVX2"


def test_the_avx2_build_of_llama_cpp_is_its_own_tree() -> None:
    native, avx2 = llama_cpp.default_bin_dir(), llama_cpp.default_bin_dir("avx2")
    assert avx2.parent.name == native.parent.name + "-avx2" and avx2.name == "bin"
    with pytest.raises(ValueError, match=r"no llama\.cpp build"):
        llama_cpp.default_bin_dir("avx512")
    missing = llama_cpp.find_tools(isa="avx2")
    if isinstance(missing, str):  # not built here
        assert f"run LLAMA_ISA=avx2 {llama_cpp.BUILD_SCRIPT}" in missing


def _fake_tool(path: Path, crash_when: str, prints: str) -> Path:
    """An executable that dies of SIGSEGV when ``crash_when`` (Python, over ``args``: its
    arguments joined by spaces) holds, else prints ``prints`` and its arguments (to
    stderr)."""
    path.write_text(
        f"#!{sys.executable}\n"
        "import os, signal, sys\n"
        "args = ' '.join(sys.argv[1:])\n"
        f"if {crash_when}:\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n"
        f"print({prints!r})\n"
        "print(' '.join(sys.argv[1:]), file=sys.stderr)\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


BENCH_JSON = json.dumps(
    [{"n_prompt": 8, "n_gen": 0, "avg_ts": 9.0}, {"n_prompt": 0, "n_gen": 4, "avg_ts": 3.0}]
)


def test_llama_cpp_runs_with_repacking_on_by_default(tmp_path: Path) -> None:
    tools = llama_cpp.Tools(
        # Repacking asked for explicitly, and not turned off: the tools' own default.
        _fake_tool(tmp_path / "llama-bench", "'--repack 1' not in args", BENCH_JSON),
        _fake_tool(tmp_path / "llama-speculative", "'--no-repack' in args", SPECULATIVE_LOG),
    )
    model = tmp_path / "m.gguf"
    run = llama_cpp.llama_bench(tools, model, threads=1, prompt=8, gen=4, reps=1)
    assert run.repack == llama_cpp.REPACK_ON
    assert run.figures["tg4"].tokens_per_s == 3.0
    spec = llama_cpp.llama_speculative(
        tools, model, model, "p", new_tokens=4, draft_max=2, threads=1, ctx=64
    )
    assert spec.repack == llama_cpp.REPACK_ON and spec.tokens == 135


def test_a_repacking_crash_runs_once_more_without_it_and_says_so(tmp_path: Path) -> None:
    tools = llama_cpp.Tools(
        # Both crash unless repacking is off, as the AMX repacking did on a Xeon.
        _fake_tool(tmp_path / "llama-bench", "'--repack 0' not in args", BENCH_JSON),
        _fake_tool(tmp_path / "llama-speculative", "'--no-repack' not in args", SPECULATIVE_LOG),
    )
    model = tmp_path / "m.gguf"
    repacking = llama_cpp.Repacking()
    run = llama_cpp.llama_bench(
        tools, model, threads=1, prompt=8, gen=4, reps=1, repacking=repacking
    )
    assert run.repack == llama_cpp.REPACK_CRASHED and run.figures["pp8"].tokens_per_s == 9.0
    spec = llama_cpp.llama_speculative(
        tools, model, model, "p", new_tokens=4, draft_max=2, threads=1, ctx=64,
        repacking=repacking,
    )  # fmt: skip
    assert spec.repack == llama_cpp.REPACK_CRASHED
    assert set(repacking.crashed) == {"llama-bench m.gguf", "llama-speculative m.gguf m.gguf"}
    assert repacking.crashed["llama-bench m.gguf"].startswith("llama-bench exited -11 (SIGSEGV):")
    # Later runs under a key that crashed go straight to the run without repacking.
    assert repacking.mode("llama-bench m.gguf") == llama_cpp.REPACK_CRASHED
    again = llama_cpp.llama_bench(
        tools, model, threads=1, prompt=8, gen=4, reps=1, repacking=repacking
    )
    assert again.repack == llama_cpp.REPACK_CRASHED
    # --llama-no-repack: off from the start, nothing crashed.
    off = llama_cpp.Repacking(disabled=True)
    run = llama_cpp.llama_bench(tools, model, threads=1, prompt=8, gen=4, reps=1, repacking=off)
    assert run.repack == llama_cpp.REPACK_OFF and not off.crashed
    # A tool that fails either way is an error, with the second failure's sentence.
    broken = llama_cpp.Tools(_fake_tool(tmp_path / "b", "True", ""), tools.speculative)
    with pytest.raises(RuntimeError, match="exited -11"):
        llama_cpp.llama_bench(broken, model, threads=1, prompt=8, gen=4, reps=1)


def test_llama_cpps_curve_is_a_batch_of_rows_after_the_same_context(tmp_path: Path) -> None:
    rows = [{"n_prompt": r, "n_gen": 0, "n_depth": 16, "avg_ts": 10.0 * r} for r in (1, 2, 5)]
    rows[2]["avg_ts"] = 25.0  # 5 tokens in 200 ms
    bench = _fake_tool(
        tmp_path / "llama-bench", "'-p 1,2,5 -n 0' not in args or '-d 16' not in args",
        json.dumps(rows),
    )  # fmt: skip
    tools = llama_cpp.Tools(bench, bench)
    args = quantized.argparse.Namespace(threads=1, bench_reps=1, pp=16)
    curve = quantized.llama_forward_curve(
        tools, tmp_path / "m.gguf", [1, 2, 5], args, llama_cpp.Repacking()
    )
    assert curve == {1: pytest.approx(100.0), 2: pytest.approx(100.0), 5: pytest.approx(200.0)}
    assert (
        quantized.llama_forward_curve(tools, tmp_path / "m.gguf", [], args, llama_cpp.Repacking())
        == {}
    )
