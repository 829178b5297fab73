"""The concurrency benchmark's arithmetic on made-up runs: latencies, ratios, targets."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.concurrency import LocalRun, Run, Stream
from bench.concurrency_report import ADAPTIVE, PLAIN, headline, markdown, summarize

OTHER = "adaptive k, another setting"


def stream(tokens: list[int], sent: float, arrivals: list[tuple[float, int]]) -> Stream:
    return Stream(sent, arrivals, tokens, "length", drafted=4, accepted=3, rounds=2)


def test_inter_token_latency_spreads_a_message_over_its_tokens() -> None:
    s = stream([1, 2, 3, 4], 0.0, [(0.5, 1), (0.6, 2), (0.9, 1)])
    assert s.ttft_s == 0.5
    per_token, gaps = s.latencies()
    assert per_token == pytest.approx([0.05, 0.05, 0.3])
    assert gaps == pytest.approx([0.1, 0.3])


def run(variant: str, c: int, rep: int, wall: float, tokens: list[int]) -> Run:
    return Run(
        variant, c, rep, wall, [stream(tokens, 0.0, [(0.1, 1), (wall, len(tokens) - 1)])] * c
    )


def test_ratios_wrong_streams_and_targets() -> None:
    same, other = [1, 2, 3, 4], [1, 2, 9, 4]
    runs = []
    for rep in range(3):
        runs += [
            run(PLAIN, 1, rep, 2.0, same),
            run(OTHER, 1, rep, 1.0, same),  # twice plain's tokens/s
            run(ADAPTIVE, 1, rep, 4.0, other if rep == 0 else same),  # half, one stream wrong
            run(PLAIN, 2, rep, 2.0, same),
            run(OTHER, 2, rep, 2.5 if rep else 1.0, same),  # 2x plain, then 0.8x
            run(ADAPTIVE, 2, rep, 2.0, same),
        ]
    local = [LocalRun("adaptive k", rep, same, 0.8, 4, 3, 2) for rep in range(3)]
    local += [LocalRun(PLAIN, rep, same, 1.0, 0, 0, 4) for rep in range(3)]
    summary = summarize(runs, local, [PLAIN, OTHER, ADAPTIVE])
    rows = {(r["variant"], r["concurrency"]): r for r in summary["stack"]}
    assert rows[(OTHER, 1)]["ratio_vs_plain"] == pytest.approx(2.0)
    assert rows[(ADAPTIVE, 1)]["ratio_vs_plain"] == pytest.approx(0.5)
    assert rows[(ADAPTIVE, 1)]["wrong_streams"] == 1 and rows[(OTHER, 1)]["wrong_streams"] == 0
    assert rows[(OTHER, 2)]["tokens_per_s"] == pytest.approx(8 / 2.5)  # the median rep
    assert rows[(OTHER, 2)]["ratios_by_rep"] == pytest.approx([2.0, 0.8, 0.8])
    assert rows[(OTHER, 1)]["acceptance_rate"] == pytest.approx(0.75)
    t = summary["targets"]
    assert t["adaptive_variant"] == ADAPTIVE  # the orchestrator's default
    assert t["adaptive_vs_plain"] == pytest.approx({1: 0.5, 2: 1.0})
    assert not t["never_worse_than_plain"]
    h = headline(summary)
    assert h["adaptive_over_plain"] == t["adaptive_vs_plain"] and not h["never_worse_than_plain"]
    assert h["stack_over_local"] == pytest.approx(0.2)
    assert t["other_variants_vs_plain"][OTHER] == pytest.approx({1: 2.0, 2: 0.8})
    # Stack single session: 4 tokens in 4 s; local: 4 tokens in 0.8 s.
    assert t["single_session_stack_over_local"] == pytest.approx(0.2)
    assert not t["single_session_met"]
    plain_local = next(r for r in summary["local"] if r["variant"] == PLAIN)
    assert plain_local["stack_over_local"] == pytest.approx(0.5)
    assert plain_local["same_tokens_as_stack"] == 3
    args = argparse.Namespace(
        target="tiny:3",
        draft="tiny:3:noise=0.05",
        target_dtype="float32",
        draft_dtype="float32",
        threads=1,
        new_tokens=4,
        reps=3,
        concurrency=[1, 2],
        emulate_devices=None,
    )
    env = {
        "date_utc": "-",
        "cpu": "-",
        "cpu_flags": {},
        "logical_cpus": 2,
        "torch": "-",
        "torch_cpu_capability": "-",
        "torch_threads": 1,
        "transformers": None,
        "python": "-",
    }
    text = markdown(summary, args, env)
    assert "**not met** (1: 0.50x, 2: 1.00x)" in text and "(0.20x)" in text
    assert "| 0.80x (2.00, 0.80, 0.80) |" in text  # the median, then each repetition's
    assert not math.isnan(rows[(PLAIN, 2)]["itl_p50_ms"])
    assert "**Device:**" not in text  # a CPU run names no device
    args.device = "cuda"
    env |= {"accelerator": "NVIDIA H100", "declared_devices": "separate"}
    on_gpu = markdown(summary, args, env)
    assert "compute on `cuda` (NVIDIA H100)" in on_gpu and "devices `separate`" in on_gpu


def test_rounds_by_k_cap_add_up_over_repetitions() -> None:
    runs = []
    for rep, caps in enumerate([{0: 3.0, 4: 10.0}, {4: 12.0, 8: 1.0}]):
        runs += [run(PLAIN, 4, rep, 2.0, [1, 2]), run(ADAPTIVE, 4, rep, 1.0, [1, 2])]
        runs[-1].k_caps = caps
    rows = {r["variant"]: r for r in summarize(runs, [], [PLAIN, ADAPTIVE])["stack"]}
    assert rows[ADAPTIVE]["k_cap_rounds"] == {0: 3.0, 4: 22.0, 8: 1.0}
    assert rows[PLAIN]["k_cap_rounds"] == {}
