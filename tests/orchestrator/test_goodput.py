"""The measured k cap: it times rounds with and without drafts, runs the cap whose
expected tokens over predicted round time is best, re-times the other side now and then,
and turns speculation off where it loses (pure: the test plays the clock and the
sessions' expectations)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from specserve.engine.k_policy import KPolicy, expected_tokens
from specserve.orchestrator.goodput import GoodputCaps, Prospect, bucket_of

T = "t:1"


@dataclass
class World:
    """A batch of ``batch`` sessions whose policies draft ``min(k, cap)`` at per-token
    acceptance ``alpha``, on a target where a round takes ``t0 + per_draft * depth +
    per_token * drafts`` (``drafts``: the batch's, ``batch * depth``)."""

    alpha: float = 0.9
    k: int = 4
    t0: float = 1.0
    per_draft: float = 0.15  # per draft step (the round's depth)
    batch: int = 8
    per_token: float = 0.0  # per drafted token of the batch
    remaining: int = 64  # tokens each session has to go

    def outlook(self, cap: int) -> Prospect:
        depth = min(self.k, cap)
        each = expected_tokens(self.alpha, depth)
        return Prospect(self.batch * each, depth, self.batch * depth, self.remaining / each)

    def seconds(self, depth: int) -> float:
        return self.t0 + self.per_draft * depth + self.per_token * self.batch * depth

    def best(self, limit: int = 8) -> int:
        finish = {
            c: self.outlook(c).rounds * self.seconds(min(self.k, c)) for c in range(limit + 1)
        }
        return min(finish, key=lambda c: (finish[c], c))


def play(caps: GoodputCaps, world: World, rounds: int, limit: int = 8) -> list[int]:
    chosen = []
    for _ in range(rounds):
        cap = caps.choose(T, world.batch, limit, world.outlook)
        chosen.append(cap)
        p = world.outlook(cap)
        caps.observe(T, world.batch, p.depth, p.drafts, world.seconds(p.depth))
    return chosen


CODE = World(alpha=0.9)  # drafting pays: the best cap is 4 (the policies' k)
PROSE = World(alpha=0.2, per_draft=0.3)  # drafts mostly rejected: plain decoding wins


def test_batch_sizes_fall_in_power_of_two_buckets() -> None:
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 3, 3, 4, 4, 5, 5, 6]


def test_drafting_is_timed_first_then_plain_then_the_best_predicted_cap_runs() -> None:
    caps = GoodputCaps(explore_every=8)
    assert CODE.best() == 4 and PROSE.best() == 0
    chosen = play(caps, CODE, rounds=14)
    assert chosen[:2] == [8, 0]
    exploit = [c for i, c in enumerate(chosen[2:], start=3) if i % 8]
    assert set(exploit) == {4}  # cap 4: 8 would predict the same time and tokens
    assert caps.seconds(T, 8, 0, 0) == pytest.approx(1.0)
    assert caps.seconds(T, 8, 2, 16) == pytest.approx(1.3)  # the line through both figures
    finish = caps.finish_times(T, 8, 8, CODE.outlook)
    assert finish[0] == pytest.approx(64 * 1.0)  # 64 rounds of 1 s
    assert finish[4] == pytest.approx(64 / expected_tokens(0.9, 4) * 1.6)


def test_a_predicted_loss_turns_speculation_off_and_exploration_keeps_checking() -> None:
    caps = GoodputCaps(explore_every=4)
    chosen = play(caps, PROSE, rounds=40)
    later = chosen[2:]
    assert later.count(0) >= 0.7 * len(later)  # plain decoding won: it runs
    assert any(c > 0 for c in later)  # drafting is re-timed now and then


def test_a_side_that_keeps_losing_is_tried_less_and_less_often() -> None:
    caps = GoodputCaps(explore_every=4, max_backoff=16)
    chosen = play(caps, PROSE, rounds=400)
    tries = [i for i, c in enumerate(chosen) if c]
    early = sum(1 for i in tries if 2 <= i < 100)
    late = sum(1 for i in tries if 300 <= i < 400)
    assert late < early  # backing off
    assert late < 25 / 3  # a fixed cadence would try 25 in every 100 rounds
    assert late >= 1  # but drafting is still re-timed (at most every 64 rounds)


def test_a_fresh_session_is_not_charged_the_depth_of_warmed_up_ones() -> None:
    """Times are by depth, not by cap: drafting timed at depth 4 predicts a 1-draft
    round at a quarter of the extra time, so a new session (acceptance prior 0.7, its
    policy drafting 1) drafts rather than sitting at plain decoding, never measured."""
    caps = GoodputCaps(explore_every=100)
    play(caps, World(alpha=0.9, k=4, batch=1, t0=0.22, per_draft=0.07), rounds=4)
    fresh = World(alpha=0.7, k=1, batch=1, t0=0.22, per_draft=0.07)
    # 1.7 tokens in 0.29 s beats 1 in 0.22 s; charged a 4-deep round (0.5 s) it would not.
    assert caps.choose(T, 1, 8, fresh.outlook) == 1


def test_an_exploration_waits_for_a_round_that_times_it() -> None:
    caps = GoodputCaps(explore_every=4)
    play(caps, PROSE, rounds=7)  # timed once each; plain runs
    assert caps.choose(T, 8, 8, PROSE.outlook) > 0  # round 8: re-time drafting
    for _ in range(5):  # its rounds are not timed (cold draft caches warming)
        assert caps.choose(T, 8, 8, PROSE.outlook) > 0
    caps.observe(T, 8, 4, 32, PROSE.seconds(4))  # timed at last: still loses
    assert caps.choose(T, 8, 8, PROSE.outlook) == 0


def test_an_exploration_that_is_never_timed_gives_up() -> None:
    caps = GoodputCaps(explore_every=4)
    play(caps, PROSE, rounds=7)
    chosen = [caps.choose(T, 8, 8, PROSE.outlook) for _ in range(40)]  # nothing timed
    assert all(c > 0 for c in chosen[: caps.patience])
    assert 0 in chosen[caps.patience :]  # back to the best after its patience


def test_an_exploration_whose_caches_will_not_warm_ends_at_once() -> None:
    caps = GoodputCaps(explore_every=4)
    play(caps, PROSE, rounds=7)
    cap = caps.choose(T, 8, 8, PROSE.outlook)  # round 8: re-time drafting
    assert cap > 0
    caps.give_up(T, 8, 0)  # not the exploration: nothing changes
    assert caps.choose(T, 8, 8, PROSE.outlook) == cap
    caps.give_up(T, 8, cap)  # a session of its round will not warm
    chosen = [caps.choose(T, 8, 8, PROSE.outlook) for _ in range(16)]
    # The best again; drafting backed off: not re-timed at round 12 (the base wait).
    assert chosen[:6] == [0] * 6


def test_a_change_in_acceptance_moves_the_choice_at_once() -> None:
    caps = GoodputCaps(explore_every=8)
    assert play(caps, CODE, rounds=6)[-1] == 4
    # The sessions' acceptance falls: plain decoding wins from the next round with
    # nothing re-timed (and one unlucky round changes nothing: the tokens a round
    # happened to commit are not what caps are judged by).
    assert play(caps, World(alpha=0.1), rounds=1) == [0]
    assert play(caps, CODE, rounds=1) == [4]


def test_a_new_batch_size_starts_from_the_nearest_timed_one() -> None:
    """Its plain time is carried over; what drafting adds is the target's fit, per
    drafted token where one batch size cannot tell steps from tokens apart."""
    caps = GoodputCaps(explore_every=100)
    play(caps, CODE, rounds=6)
    assert caps.choose(T, 6, 8, CODE.outlook) == 4  # same bucket
    assert caps.choose(T, 16, 8, World(batch=16).outlook) == 4  # no exploring from scratch
    assert caps.seconds(T, 16, 0, 0) == pytest.approx(1.0)
    assert caps.seconds(T, 16, 3, 48) == pytest.approx(1.0 + 48 * 0.15 / 8)
    assert caps.choose("other:1", 8, 8, CODE.outlook) == 8  # another target knows nothing


def test_a_smaller_batch_is_predicted_from_a_larger_ones_cost_per_draft() -> None:
    caps = GoodputCaps(explore_every=100)
    play(caps, World(alpha=0.9, per_draft=1.0), rounds=4)  # 8 sessions: drafting loses
    assert caps.choose(T, 8, 8, CODE.outlook) == 0
    # One session: its drafts are an eighth of 8 sessions', so is the time they add
    # (read per drafted token); drafting pays at this batch and runs at once.
    alone = World(alpha=0.9, batch=1, t0=0.2, per_draft=0.05)
    chosen = play(caps, alone, rounds=4)
    assert chosen == [4, 4, 4, 4]
    assert caps.seconds(T, 1, 0, 0) == pytest.approx(1.0)  # plain carried over, not re-timed


def test_rounds_of_several_batch_sizes_tell_steps_from_drafted_tokens() -> None:
    """On a compute-bound target a drafted token costs the verify about the same at any
    batch, and the draft's steps cost per step: fitted from rounds of 1 and of 8
    sessions, a round of 4 is predicted without being timed (the Xeon's figures: 0.039
    s a step, 0.019 s a drafted token). Where the verify is free (a GPU), the cost is
    all per step and a batch of 8 drafts as cheaply as one session."""
    for per_step, per_token in ((0.039, 0.019), (0.05, 0.0)):
        caps = GoodputCaps(explore_every=100)
        for batch, t0 in ((1, 0.21), (8, 0.26)):
            world = World(batch=batch, t0=t0, per_draft=per_step, per_token=per_token)
            caps.choose(T, batch, 8, world.outlook)
            caps.observe(T, batch, 0, 0, t0)
            for depth in (1, 2, 4, 3, 1, 2):
                caps.observe(T, batch, depth, batch * depth, world.seconds(depth))
        cost = caps.cost(T)
        assert cost is not None
        assert cost.per_step == pytest.approx(per_step, abs=1e-6)
        assert cost.per_token == pytest.approx(per_token, abs=1e-6)
        assert cost.fixed == pytest.approx(0.0, abs=1e-6)
        caps.choose(T, 4, 8, World(batch=4).outlook)  # t0 carried from the nearest (2 or 8)
        t0 = caps.seconds(T, 4, 0, 0)
        assert t0 is not None
        assert caps.seconds(T, 4, 2, 8) == pytest.approx(t0 + 2 * per_step + 8 * per_token)


def test_the_sessions_policies_get_the_fitted_cost_in_plain_rounds_of_their_batch() -> None:
    """What each session's k policy plans with: the target's fitted drafting cost over
    the plain time of the round's batch size (the Xeon's lone session: a drafted token
    0.058 s over a 0.25 s plain round, 0.23 of one, where the static guess says 0.55)."""
    caps = GoodputCaps(explore_every=100)
    assert caps.relative_cost(T, 1) is None  # nothing timed
    world = World(batch=1, t0=0.25, per_draft=0.039, per_token=0.019)
    caps.choose(T, 1, 8, world.outlook)
    for depth in (1, 2, 4, 3):
        caps.observe(T, 1, depth, depth, world.seconds(depth))
    assert caps.relative_cost(T, 1) is None  # no plain round yet: no t0 to relate to
    caps.observe(T, 1, 0, 0, 0.25)
    cost = caps.relative_cost(T, 1)
    assert cost is not None
    assert cost.draft_per_token + cost.verify_per_token == pytest.approx(0.058 / 0.25)
    assert cost.round(4) == pytest.approx(world.seconds(4) / 0.25)
    assert KPolicy(None, alpha0=0.85, cost=cost).plan(8) > KPolicy(None, alpha0=0.85).plan(8)
    assert caps.relative_cost(T, 8) is None  # a batch size never chosen


def test_the_curves_bound_is_respected() -> None:
    caps = GoodputCaps()
    assert caps.choose(T, 40, 0, CODE.outlook) == 0
    assert all(c <= 3 for c in play(caps, CODE, rounds=12, limit=3))
    caps.forget(T)
    assert caps.seconds(T, 8, 0, 0) is None and caps.cost(T) is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="explore_every"):
        GoodputCaps(explore_every=1)
    with pytest.raises(ValueError, match="smoothing"):
        GoodputCaps(smoothing=0)
    with pytest.raises(ValueError, match="max_backoff"):
        GoodputCaps(max_backoff=0)


def test_drafting_rounds_at_several_depths_give_a_fixed_cost_and_a_slope() -> None:
    """A drafting round costs a fixed amount over a plain one (the Propose call, the
    draft's step setup) plus each draft. Timed at one depth the two are one slope
    through the plain time; once rounds at other depths are timed both are fitted, and
    deep rounds are no longer charged the fixed cost once per draft."""
    t0, fixed, per_draft = 0.30, 0.20, 0.05
    caps = GoodputCaps(explore_every=100, smoothing=0.3)
    world = World(alpha=0.9, k=1)
    caps.choose(T, 8, 8, world.outlook)
    caps.observe(T, 8, 0, 0, t0)
    caps.observe(T, 8, 1, 8, t0 + fixed + per_draft)  # one depth: all of it per draft
    assert caps.seconds(T, 8, 8, 64) == pytest.approx(t0 + 8 * (fixed + per_draft))
    for depth in (4, 1, 4, 2, 4, 1, 3, 4):
        caps.observe(T, 8, depth, 8 * depth, t0 + fixed + per_draft * depth)
    assert caps.seconds(T, 8, 8, 64) == pytest.approx(t0 + fixed + 8 * per_draft)
    assert caps.seconds(T, 8, 1, 8) == pytest.approx(t0 + fixed + per_draft)
    assert caps.seconds(T, 8, 0, 0) == pytest.approx(t0)
    # With the fit, cap 4 (k = 4 drafts, 4.1 tokens a session) beats cap 1 at alpha 0.9;
    # the one-depth line would have charged 4 drafts 1.0 s and kept cap 1.
    deep = World(alpha=0.9, k=4)
    finish = caps.finish_times(T, 8, 8, deep.outlook)
    assert min(finish, key=lambda c: finish[c]) == 4


def test_a_fit_that_puts_drafting_below_plain_falls_back_to_the_line_through_it() -> None:
    caps = GoodputCaps(explore_every=100)
    caps.choose(T, 8, 8, CODE.outlook)
    caps.observe(T, 8, 0, 0, 1.0)
    for depth, seconds in ((1, 1.0), (4, 2.0), (1, 1.0), (4, 2.0)):  # intercept < t0
        caps.observe(T, 8, depth, 8 * depth, seconds)
    line = caps.seconds(T, 8, 1, 8)
    assert line is not None and line > 1.0  # drafting never predicted at or below plain


def test_the_batch_finishes_with_its_slowest_turn() -> None:
    """Seven sessions the draft guesses well and one it does not (its policy drafts
    nothing): drafting raises the batch's tokens per second, but the eighth session
    makes one token a round at the drafting rounds' time, so the batch would finish
    later; plain decoding runs. Without it, drafting runs."""
    caps = GoodputCaps(explore_every=100)
    world = World(alpha=0.9, t0=0.27, per_draft=0.04, per_token=0.019)
    play(caps, world, rounds=3)  # drafting, then plain, timed
    good, bad = world.outlook, World(alpha=0.9, k=0).outlook

    def mixed(cap: int) -> Prospect:
        g, b = good(cap), bad(cap)
        tokens = g.tokens * 7 / 8 + b.tokens / 8
        return Prospect(tokens, g.depth, g.drafts * 7 // 8, max(g.rounds, b.rounds))

    two = mixed(2)
    seconds = 0.27 + 0.04 * 2 + 0.019 * two.drafts
    assert two.tokens / seconds > 1.08 * 8 / 0.27  # the batch's tokens/s rise 8% at cap 2
    assert caps.choose(T, 8, 8, mixed) == 0
    assert caps.choose(T, 8, 8, good) == 2  # deeper drafts cost 8 tokens a step here


def test_plain_time_is_a_median_a_few_slow_rounds_do_not_move() -> None:
    caps = GoodputCaps(explore_every=100)
    play(caps, CODE, rounds=2)
    for seconds in (1.0, 1.0, 1.0, 1.0, 1.0, 1.5, 1.6, 1.7):  # something else ran
        caps.observe(T, 8, 0, 0, seconds)
    assert caps.seconds(T, 8, 0, 0) == pytest.approx(1.0)


def test_where_no_session_would_draft_the_cap_leaves_their_probes_alone() -> None:
    """Policies that plan k = 0 under every cap predict the same round at every cap;
    the cap is then the bound, not 0, so a policy's probe (one draft every few rounds)
    can still win speculation back. Where drafts differ, the tie goes to fewer."""
    caps = GoodputCaps(explore_every=100)
    play(caps, CODE, rounds=3)  # drafting and plain timed
    assert caps.choose(T, 8, 6, World(alpha=0.3, k=0).outlook) == 6
    assert caps.choose(T, 8, 6, CODE.outlook) == 4  # caps 4-6 alike: the smaller
