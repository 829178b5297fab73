"""bench.experiments.long_prompt_fairness runs end to end on tiny models (a short prompt, nothing
written): both orchestrators, the streams, and every figure of its headline."""

from __future__ import annotations

import pytest

from bench.experiments import long_prompt_fairness


@pytest.mark.timeout(600)  # three processes start; a minute on a busy machine
def test_a_short_run_measures_the_gaps_and_both_first_tokens() -> None:
    argv = ["--tokens", "600", "--warm-tokens", "20", "--normal-s", "0.3", "--no-write"]
    data = long_prompt_fairness.main(argv)
    head = data["headline"]
    assert head["tokens"] == 600 and head["streams"] == 2
    assert head["normal_gap_ms"] > 0 and head["largest_gap_ms"] >= head["normal_gap_ms"]
    assert head["alone_largest_gap_ms"] > 0
    assert head["ttft_s"] > 0 and head["one_round_ttft_s"] > 0
    assert head["chunks"] >= 1  # 600 tokens do not fit a round beside two streams
