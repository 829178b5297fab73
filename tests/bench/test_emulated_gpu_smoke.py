"""bench.emulated_gpu runs end to end on tiny models (one setting, few tokens, nothing
written), and its targets are judged from the figures it measured."""

from __future__ import annotations

import pytest

from bench import emulated_gpu, emulated_gpu_report, serving_stack


@pytest.mark.timeout(1800)  # three processes and a local loop start; minutes on a busy machine
def test_a_short_run_measures_every_ratio_and_where_a_round_goes() -> None:
    argv = ["--settings", "2/12", "--sessions", "1,2", "--reps", "1", "--steady-waves", "2"]
    argv += ["--new-tokens", "24", "--traced", "1", "--no-write"]  # a lone adaptive
    # session drafts up to 8 a round from its first: 24 tokens leave it decode rounds
    data = emulated_gpu.main(argv)
    headline = data["headline"]
    assert set(headline["stack_over_local"]["2/12"]) == {"plain", "adaptive"}
    assert set(headline["adaptive_over_plain"]["2/12"]) == {"1", "2"}
    assert headline["greedy_equal"]
    claims = [t["claim"] for t in headline["targets"]]
    assert "2/12: one session through the stack / local loop, adaptive" in claims
    assert "2/12: adaptive / plain through the stack at 2 sessions, constant concurrency" in claims
    setting = data["settings"]["2/12"]
    steady = setting["steady"]["2"]  # 2 slots, 2 requests each, same prompts both ways
    assert steady["requests"] == 8 and steady["wrong_streams"] == 0
    assert steady["ratio"] > 0 and set(steady["tokens_per_s"]) == {"plain", "adaptive"}
    assert "1" not in setting["steady"]  # one session: the closed batch is the same load
    assert 0 <= setting["closed_tail"]["2"]["tail_share"] < 1
    assert setting["greedy"]["compared"] > 0
    for variant in ("plain", "adaptive"):
        phases = setting["phases"][variant]
        assert phases["rounds"] > 0
        ms = phases["ms_per_round"]
        assert ms["device"] >= 12.0  # at least the target's forward, every round
        assert ms["transport"] > 0 and ms["servers"] > 0
        assert sum(ms[p] for p in emulated_gpu_report.PARTS) == pytest.approx(ms["round"])
    cpu = data["fidelity"]["cpu_ms"]
    assert set(cpu) == {"draft_step", "target_verify", "target_step"}
    assert all(set(widths) == {1, 2} and min(widths.values()) > 0 for widths in cpu.values())
    assert "2/12" in data["fidelity"]["cpu_bound"]
    prefill = data["fidelity"]["prefill_cpu_ms"]
    assert prefill["draft_prefill"] > 0 and prefill["target_prefill"] > 0 and prefill["tokens"] > 1


def test_targets_are_judged_from_the_figures() -> None:
    setting = {
        "stack_over_local": {"plain": {"median": 0.97}, "adaptive": {"median": 0.9}},
        "adaptive_over_plain": {"1": 1.1, "8": 1.4, "32": 1.25},
    }
    verdicts = {t["claim"]: t["met"] for t in emulated_gpu_report.targets({"2/12": setting})}
    assert verdicts == {
        "2/12: one session through the stack / local loop, plain": True,
        "2/12: one session through the stack / local loop, adaptive": False,
        "2/12: adaptive / plain through the stack at 1 sessions": True,
        "2/12: adaptive / plain through the stack at 8 sessions": False,
        "2/12: adaptive / plain through the stack at 32 sessions": True,
    }


def test_a_setting_is_draft_ms_slash_target_ms() -> None:
    assert emulated_gpu.Setting.parse("1/6").label == "1/6"
    with pytest.raises(ValueError, match="DRAFT_MS/TARGET_MS"):
        emulated_gpu.Setting.parse("2,12")


def test_draft_ahead_reaches_the_draft_server_only() -> None:
    setting = emulated_gpu.Setting(2.0, 12.0)
    on = emulated_gpu.stack_namespace(emulated_gpu.parse_args(["--draft-ahead", "5"]), setting)
    flags, module = serving_stack.server_flags(on)
    assert module == "bench.emulated_device"
    assert flags["draft"][:3] == ["draft", "--forward-ms", "2.0"]
    assert flags["draft"][-2:] == ["--draft-ahead", "5"]
    assert "--draft-ahead" not in flags["target"]
    default = emulated_gpu.stack_namespace(emulated_gpu.parse_args([]), setting)
    assert serving_stack.server_flags(default)[0]["draft"][-2:] == ["--draft-ahead", "9"]
    off = emulated_gpu.stack_namespace(emulated_gpu.parse_args(["--draft-ahead", "0"]), setting)
    assert "--draft-ahead" not in serving_stack.server_flags(off)[0]["draft"]


def test_fewer_session_counts_send_the_default_runs_prompts() -> None:
    # Repetition r's block starts at r * 32 whatever --sessions holds, so `--sessions 1`
    # decodes the lone prompts of `--sessions 1,8,32` (the local loop's too).
    assert emulated_gpu.prompt_block([1]) == emulated_gpu.prompt_block([1, 8, 32]) == 32
    assert emulated_gpu.prompt_block([1, 64]) == 64
