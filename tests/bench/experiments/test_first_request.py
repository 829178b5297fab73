"""bench.experiments.first_request: its criterion on made-up runs, and one run end to end on tiny
models (nothing written), so that the benchmark keeps starting."""

from __future__ import annotations

import pytest

from bench.experiments import first_request
from bench.experiments.first_request import headline, outcome


def test_the_criterion_is_the_mean_acceptance_length_within_twenty_percent() -> None:
    local = outcome([1, 2, 3, 4], 1.0, rounds=10, drafted=40, accepted=20)  # length 3.0
    fast = outcome([1, 2, 3, 4], 2.0, rounds=10, drafted=40, accepted=15)  # 2.5: 0.83x
    slow = outcome([1, 2, 3, 5], 2.0, rounds=10, drafted=40, accepted=13)  # 2.3: 0.77x
    h = headline(local, fast)
    assert h["mean_acceptance_length_stack_over_local"] == pytest.approx(2.5 / 3.0)
    assert h["within_20_percent"] and h["same_tokens"]
    h = headline(local, slow)
    assert not h["within_20_percent"] and not h["same_tokens"]
    assert h["stack_first_request"]["tokens_per_s"] == pytest.approx(2.0)


def test_a_run_on_tiny_models_compares_the_first_request_with_the_local_loop(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--tiny", "--threads", "1", "--new-tokens", "12", "--no-write"]
    assert first_request.main(argv) == 0
    md = capsys.readouterr().out
    assert "| local loop (`generate --local -k auto`) |" in md
    assert "| fresh stack, first request |" in md
    assert "- Same tokens: yes." in md  # greedy, float32: the stack is lossless
