"""The measured k cap: it times each cap, runs the one whose expected tokens over its
round time is best, re-times, and turns speculation off where it loses (pure: the test
plays the clock and the sessions' expectations)."""

from __future__ import annotations

import pytest

from specserve.orchestrator.goodput import GoodputCaps, bucket_of

T = "t:1"


def play(
    caps: GoodputCaps,
    tokens_of: dict[int, float],
    seconds_of: dict[int, float],
    rounds: int,
    batch: int = 8,
    limit: int = 8,
) -> list[int]:
    """Play ``rounds`` rounds: the batch expects ``tokens_of[c]`` tokens a round at cap c,
    and a round at cap c takes ``seconds_of[c]``."""
    chosen = []
    for _ in range(rounds):
        cap = caps.choose(T, batch, limit, tokens_of.__getitem__)
        chosen.append(cap)
        caps.observe(T, batch, cap, seconds=seconds_of[cap])
    return chosen


def tokens(rate_of: dict[int, float], batch: int = 8) -> dict[int, float]:
    """Expected tokens a round by cap: more drafts, more tokens."""
    return {c: batch * (1 + c / 4) for c in rate_of}


EXPECT = tokens({0: 0, 2: 0, 4: 0, 8: 0}).__getitem__  # what run() expects of a batch of 8


def run(caps: GoodputCaps, rate_of: dict[int, float], rounds: int, batch: int = 8) -> list[int]:
    """Play rounds where cap c yields ``rate_of[c]`` tokens/s per session."""
    want = tokens(rate_of, batch)
    seconds = {c: want[c] / (rate_of[c] * batch) for c in rate_of}
    return play(caps, want, seconds, rounds, batch)


def test_batch_sizes_fall_in_power_of_two_buckets() -> None:
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 3, 3, 4, 4, 5, 5, 6]


def test_arms_are_0_2_4_and_the_bound() -> None:
    assert GoodputCaps.arms(8) == [0, 2, 4, 8]
    assert GoodputCaps.arms(3) == [0, 2, 3]
    assert GoodputCaps.arms(1) == [0, 1]


def test_every_cap_is_tried_once_from_the_bound_down_then_the_best_runs() -> None:
    caps = GoodputCaps(explore_every=8)
    chosen = run(caps, {0: 1.0, 2: 2.0, 4: 3.0, 8: 2.5}, rounds=14)
    assert chosen[:4] == [8, 4, 2, 0]
    exploit = [c for i, c in enumerate(chosen[4:], start=5) if i % 8]
    assert set(exploit) == {4}
    rates = {0: 1.0, 2: 2.0, 4: 3.0, 8: 2.5}
    assert caps.rates(T, 8, tokens(rates).__getitem__) == pytest.approx(rates)


def test_a_measured_loss_turns_speculation_off_and_exploration_keeps_checking() -> None:
    caps = GoodputCaps(explore_every=4)
    chosen = run(caps, {0: 2.0, 2: 1.5, 4: 1.2, 8: 0.6}, rounds=40)
    later = chosen[4:]
    assert later.count(0) >= 0.7 * len(later)  # plain decoding won: it runs
    assert {2, 4, 8} <= set(later)  # the others are re-measured now and then


def test_a_cap_that_keeps_losing_is_tried_less_and_less_often() -> None:
    caps = GoodputCaps(explore_every=4, max_backoff=16)
    chosen = run(caps, {0: 2.0, 2: 1.5, 4: 1.2, 8: 0.6}, rounds=400)
    tries = [i for i, c in enumerate(chosen) if c]
    early = sum(1 for i in tries if 4 <= i < 100)
    late = sum(1 for i in tries if 300 <= i < 400)
    assert late < early  # backing off
    assert late < 25 / 3  # a fixed cadence would try 25 in every 100 rounds
    assert late >= 3  # but every losing cap is still re-measured (at most every 64 rounds)


def test_an_exploration_waits_for_a_round_that_measures_it() -> None:
    caps = GoodputCaps(explore_every=4)
    run(caps, {0: 2.0, 2: 1.5, 4: 1.2, 8: 0.6}, rounds=7)  # tried once each; 0 runs
    assert caps.choose(T, 8, 8, EXPECT) == 8  # round 8: re-measure the oldest loser
    for _ in range(5):  # its rounds are not measured (cold draft caches warming)
        assert caps.choose(T, 8, 8, EXPECT) == 8
    caps.observe(T, 8, 8, seconds=8 * 3 / (0.6 * 8))  # timed at last: still loses
    assert caps.choose(T, 8, 8, EXPECT) == 0


def test_an_exploration_that_is_never_measured_gives_up() -> None:
    caps = GoodputCaps(explore_every=4)
    run(caps, {0: 2.0, 2: 1.5, 4: 1.2, 8: 0.6}, rounds=7)
    chosen = [caps.choose(T, 8, 8, EXPECT) for _ in range(20)]  # nothing measured
    assert chosen[: caps.patience] == [8] * caps.patience
    assert 0 in chosen[caps.patience :]  # back to the best after its patience


def test_an_exploration_whose_caches_will_not_warm_ends_at_once() -> None:
    caps = GoodputCaps(explore_every=4)
    run(caps, {0: 2.0, 2: 1.5, 4: 1.2, 8: 0.6}, rounds=7)
    assert caps.choose(T, 8, 8, EXPECT) == 8  # round 8: re-measure the oldest loser
    caps.give_up(T, 8, 4)  # not the exploration: nothing changes
    assert caps.choose(T, 8, 8, EXPECT) == 8
    caps.give_up(T, 8, 8)  # a session of its round will not warm
    chosen = [caps.choose(T, 8, 8, EXPECT) for _ in range(16)]
    assert chosen[0] == 0  # the best again, the next round
    assert 8 not in chosen  # and the arm backed off: not due again at the base wait


def test_a_change_in_acceptance_moves_the_choice_at_once() -> None:
    caps = GoodputCaps(explore_every=8)
    seconds = {0: 1.0, 2: 1.3, 4: 1.6, 8: 2.4}  # what a round costs: steady
    code = {0: 8.0, 2: 8 * 2.7, 4: 8 * 4.0, 8: 8 * 5.6}  # acceptance 0.9
    prose = {0: 8.0, 2: 8 * 1.2, 4: 8 * 1.25, 8: 8 * 1.25}  # acceptance 0.2
    chosen = play(caps, code, seconds, rounds=10)  # timed once each, then cap 4 runs
    assert chosen[:4] == [8, 4, 2, 0] and chosen[-1] == 4
    # The sessions' acceptance falls: plain decoding wins from the next round, with
    # no cap re-timed (one unlucky round at a good cap, by contrast, changes nothing:
    # the tokens a round happened to commit are not what arms are judged by).
    assert play(caps, prose, seconds, rounds=3) == [0, 0, 0]
    assert play(caps, code, seconds, rounds=1) == [4]


def test_a_new_batch_size_starts_from_the_nearest_measured_one() -> None:
    caps = GoodputCaps(explore_every=100)
    run(caps, {0: 1.0, 2: 2.0, 4: 3.0, 8: 2.5}, rounds=6, batch=8)
    assert caps.choose(T, 6, 8, EXPECT) == 4  # same bucket
    assert caps.choose(T, 16, 8, EXPECT) == 4  # new bucket: no exploring from scratch
    assert caps.seconds(T, 16) == pytest.approx(caps.seconds(T, 8))
    assert caps.choose("other:1", 8, 8, EXPECT) == 8  # another target knows nothing yet


def test_a_smaller_batch_tries_the_caps_above_the_larger_batchs_best_first() -> None:
    caps = GoodputCaps(explore_every=100)
    run(caps, {0: 1.0, 2: 1.4, 4: 1.2, 8: 0.8}, rounds=6, batch=8)  # 8 sessions: cap 2
    # One session: 8 and 4 were not measured at this batch; the bound is tried first.
    alone = run(caps, {0: 4.0, 2: 5.0, 4: 5.5, 8: 6.0}, rounds=6, batch=1)
    assert alone[:2] == [8, 4]
    assert alone[2:] == [8] * 4  # no rounds held at cap 2 by the larger batch's figure
    assert caps.choose(T, 16, 8, EXPECT) == 2  # a larger batch still starts from cap 2


def test_the_curves_bound_is_respected() -> None:
    caps = GoodputCaps()
    assert caps.choose(T, 40, 0, EXPECT) == 0
    assert all(c <= 3 for c in run_limited(caps, limit=3, rounds=12))
    caps.forget(T)
    assert caps.seconds(T, 8) == {}


def run_limited(caps: GoodputCaps, limit: int, rounds: int) -> list[int]:
    chosen = []
    for _ in range(rounds):
        cap = caps.choose(T, 8, limit, lambda c: 8.0 * (c + 1))
        chosen.append(cap)
        caps.observe(T, 8, cap, seconds=1.0)
    return chosen


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="explore_every"):
        GoodputCaps(explore_every=1)
    with pytest.raises(ValueError, match="smoothing"):
        GoodputCaps(smoothing=0)
    with pytest.raises(ValueError, match="max_backoff"):
        GoodputCaps(max_backoff=0)
