"""The scheduler's pure logic: load, placement, affinity, lanes, continuous batching."""

from __future__ import annotations

import pytest

from specserve.orchestrator.fleet.scheduler import (
    NoReplica,
    Placement,
    Scheduler,
    SchedulerConfig,
)


def test_target_load_counts_the_sessions_placed_on_it() -> None:
    s = Scheduler()
    s.set_usable(["t1", "t2"], ["d1"])
    for i in range(4):
        s.join(f"s{i}", Placement("t1", "d1"))
    assert s.target_load("t1") == 4 and s.target_load("t2") == 0
    s.leave("s0")
    s.leave("s1")
    assert s.target_load("t1") == 2


def test_placement_balances_and_prefers_warm_replicas() -> None:
    s = Scheduler()
    s.set_usable(["t1", "t2"], ["d1", "d2"])
    a = s.place("a")
    s.join("a", a)
    b = s.place("b")
    s.join("b", b)
    assert {a.target, b.target} == {"t1", "t2"}
    assert {a.draft, b.draft} == {"d1", "d2"}
    # Affinity beats load: the replica with the warm cache is kept.
    c = s.place("c", prefer_target=a.target, prefer_draft=a.draft)
    assert (c.target, c.draft) == (a.target, a.draft)
    # ... unless it is no longer usable.
    s.set_usable(["t2"], [])
    d = s.place("d", prefer_target="t1", prefer_draft="d1")
    assert (d.target, d.draft) == ("t2", None)
    with pytest.raises(NoReplica):
        s.place("e", avoid_targets=["t2"])


def test_a_targets_sessions_share_one_lane() -> None:
    s = Scheduler()
    s.set_usable(["t"], ["d"])
    for i in range(5):
        s.join(f"s{i}", s.place(f"s{i}"))
    assert s.lanes() == ["t"] and len(s.begin_round("t").ids) == 5


def test_continuous_batching_joins_and_leaves_at_round_boundaries() -> None:
    s = Scheduler()
    s.set_usable(["t"], ["d"])
    lane = s.join("a", s.place("a"))
    assert s.begin_round(lane).ids == ["a"]
    s.join("b", s.place("b"))  # arrives mid-round: runs from the next round
    s.end_round([])
    assert sorted(s.begin_round(lane).ids) == ["a", "b"]
    s.end_round(["a"])
    assert s.begin_round(lane).ids == ["b"]
    s.end_round(["b"])
    assert s.begin_round(lane).ids == [] and s.lanes() == []


def test_batches_rotate_when_a_lane_exceeds_max_batch() -> None:
    s = Scheduler(SchedulerConfig(max_batch=2))
    s.set_usable(["t"], [])
    for sid in "abc":
        s.join(sid, s.place(sid))
    seen = [s.begin_round("t").ids for _ in range(3)]
    assert all(len(b) == 2 for b in seen)
    counts = {sid: sum(sid in b for b in seen) for sid in "abc"}
    assert counts == {"a": 2, "b": 2, "c": 2}


def test_move_and_set_draft() -> None:
    s = Scheduler()
    s.set_usable(["t1", "t2"], ["d1"])
    s.join("a", Placement("t1", "d1"))
    s.begin_round("t1")
    new = s.place("a", avoid_targets=["t1"])
    assert new.target == "t2"
    s.move("a", new)
    assert s.begin_round("t1").ids == [] and s.begin_round("t2").ids == ["a"]
    s.set_draft("a", None)
    placement = s.placement("a")
    assert placement is not None and placement.draft is None
    assert s.draft_load("d1") == 0


def test_a_round_sends_at_most_its_budget_and_long_prompts_go_in_chunks() -> None:
    s = Scheduler(SchedulerConfig(max_prefill_tokens=300))
    lane = "t1"
    behind = {"d1": 1, "p1": 200, "p2": 200, "d2": 5, "p3": 90, "huge": 5000}
    for sid in behind:
        s.join(sid, Placement("t1", "d1"))

    def prefill(sid: str) -> int:
        return behind[sid]

    # Decoding sessions always go and are charged first (6 rows); prompts take the
    # rest in line order: p1 whole, p2 the 94 rows left; p3 and huge wait.
    first = s.begin_round(lane, prefill)
    assert first.ids == ["d1", "p1", "p2", "d2"] and first.chunks == {"p2": 94}
    for sid in ("d1", "p1", "d2"):
        behind[sid] = 1  # prefilled / decoded: a round's worth behind now
    behind["p2"] -= 94
    # The chunked prompt goes first, then whoever waited; huge gets what is left.
    second = s.begin_round(lane, prefill)
    assert second.ids == ["p2", "p3", "huge", "d1", "p1", "d2"]
    assert second.chunks == {"huge": 300 - 3 - 106 - 90}
    behind["p2"] = behind["p3"] = 1
    behind["huge"] -= second.chunks["huge"]
    # The measured allowance at a prompt's position bounds its tokens (the decoding rows
    # are in the usual round it is measured against); huge stays first until prefilled.
    third = s.begin_round(lane, prefill, lambda sid: 50 if sid == "huge" else 0)
    assert third.ids[0] == "huge" and third.chunks == {"huge": 50}
    # An allowance of 0 keeps the round usual (the prompt waits, first in line) ...
    kept = s.begin_round(lane, prefill, lambda sid: 0)
    assert "huge" not in kept.ids and not kept.chunks
    assert s.begin_round(lane, prefill, lambda sid: 40).chunks == {"huge": 40}
    # ... unless nothing else would run: a prompt alone always progresses.
    alone = Scheduler(SchedulerConfig(max_prefill_tokens=300))
    alone.join("huge", Placement("t1", "d1"))
    assert alone.begin_round(lane, prefill, lambda sid: 0).chunks == {"huge": 1}
    no_costs = s.begin_round(lane)
    assert len(no_costs.ids) == len(behind) and not no_costs.chunks  # no budget applies


def test_prompts_that_go_whole_spend_the_allowance_of_the_one_chunked_after_them() -> None:
    s = Scheduler(SchedulerConfig(max_prefill_tokens=10_000))
    behind = {"short": 100, "long": 5000, "later": 200}
    for sid in behind:
        s.join(sid, Placement("t1", "d1"))
    allowance = {"short": 400, "long": 300, "later": 400}  # the long one holds more
    batch = s.begin_round("t1", behind.__getitem__, allowance.__getitem__)
    assert batch.ids == ["short", "long"] and batch.chunks == {"long": 300 - 100}


def test_a_chunked_prompts_short_tail_is_charged_as_a_prompt() -> None:
    """The last 20 tokens of a prompt sent in chunks are within a round's worth
    (DECODING_TOKENS) but still a prompt's: the allowance bounds them."""
    s = Scheduler(SchedulerConfig(max_prefill_tokens=10_000))
    behind = {"d": 1, "long": 100}
    for sid in behind:
        s.join(sid, Placement("t1", "d1"))
    assert s.begin_round("t1", behind.__getitem__, lambda sid: 80).chunks == {"long": 80}
    behind["long"] = 20
    second = s.begin_round("t1", behind.__getitem__, lambda sid: 8)
    assert second.chunks == {"long": 8} and not second.tails
    behind["long"] = 12
    third = s.begin_round("t1", behind.__getitem__, lambda sid: 12)
    assert third.tails == {"long"} and not third.chunks  # its last part, whole
    behind["long"] = 1
    assert not s.begin_round("t1", behind.__getitem__, lambda sid: 0).tails  # decoding now


def test_a_round_of_decoding_sessions_only_is_never_cut() -> None:
    s = Scheduler(SchedulerConfig(max_prefill_tokens=4))
    for sid in "abcdef":
        s.join(sid, Placement("t1", "d1"))
    batch = s.begin_round("t1", lambda sid: 2)
    assert len(batch.ids) == 6 and not batch.chunks


def test_max_prefill_tokens_is_validated() -> None:
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        SchedulerConfig(max_prefill_tokens=0)
