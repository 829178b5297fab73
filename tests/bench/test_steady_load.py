"""bench.steady_load's pure parts: which prompts a repetition sends, how the runs are
summarised, and how a closed batch's tail is measured."""

from __future__ import annotations

import pytest

from bench.serving_stack import Run, Stream
from bench.steady_load import SteadyRun, steady_prompts, summarize, tail_of


def stream(sent: float, end: float, tokens: list[int], drafted: int, accepted: int) -> Stream:
    return Stream(sent, [(end, len(tokens))], list(tokens), "length", drafted, accepted, 1)


def test_a_repetition_sends_waves_from_its_own_block_wrapping_round() -> None:
    prompts = [[i] for i in range(6)]
    assert steady_prompts(prompts, 0, 2, 3, 2) == [[0], [1], [2], [3]]
    assert steady_prompts(prompts, 1, 2, 3, 2) == [[3], [4], [5], [0]]


def test_adaptive_over_plain_is_taken_per_repetition_and_differing_tokens_are_counted() -> None:
    def run(variant: str, rep: int, tokens: int, streams: list[list[int]]) -> SteadyRun:
        made = [stream(0.0, 1.0, t, 0, 0) for t in streams]
        return SteadyRun(variant, 2, rep, 1.0, tokens, made)

    runs = [
        run("plain", 0, 100, [[1, 2], [3, 4]]),
        run("adaptive", 0, 150, [[1, 2], [3, 4]]),
        run("plain", 1, 100, [[5], [6]]),
        run("adaptive", 1, 250, [[5], [7]]),  # one stream differs from plain's
    ]
    s = summarize(runs)["2"]
    assert s["ratios_by_rep"] == [1.5, 2.5]
    assert s["ratio"] == 2.0
    assert s["tokens_per_s"] == {"plain": 100.0, "adaptive": 200.0}
    assert s["requests"] == 8
    assert s["wrong_streams"] == 1


def test_a_closed_batch_tail_is_the_time_after_half_its_streams_ended() -> None:
    streams = [
        stream(0.0, 1.0, [1] * 8, 8, 7),
        stream(0.0, 2.0, [1] * 8, 8, 6),
        stream(0.0, 4.0, [1] * 8, 10, 4),  # the last to finish, the least accepted
    ]
    t = tail_of(Run("adaptive", 3, 0, 4.0, streams))
    assert t["tail_share"] == pytest.approx(0.5)  # half ended at 2.0 of 4.0
    assert t["last_acceptance"] == pytest.approx(0.4)
    assert t["batch_acceptance"] == pytest.approx(17 / 26)
