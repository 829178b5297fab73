"""The hop a forwarded proposal would remove, read from a hand-built batch round (no
processes): counted once per batch round, only where the round drafted."""

from __future__ import annotations

import pytest

from bench.experiments.forwarding_hop import round_hops
from specserve.telemetry.receiver import ReceivedSpan

MS = 1_000_000  # ns


def span(
    sid: str, parent: str, name: str, start: int, end: int, kind: str = "internal"
) -> ReceivedSpan:
    return ReceivedSpan("t" * 32, sid, parent, name, kind, start * MS, end * MS, {}, {})


def batch_round(drafting: bool = True) -> list[ReceivedSpan]:
    """A 30 ms round of two sessions: the leader's round span holds Propose 0-5 (server
    1-4, forward 1-3) and Verify 6-22 (server 7-21); the other session's has nothing."""
    spans = [
        span("r", "req", "specserve.round", 0, 30),
        span("r2", "req2", "specserve.round", 0, 30),
        span("p", "r", "specserve.propose", 0, 5),
        span("v", "r", "specserve.verify", 6, 22),
        span("vc", "v", "/specserve.v1.TargetService/Verify", 6, 22, "client"),
        span("vs", "vc", "/specserve.v1.TargetService/Verify", 7, 21, "server"),
        span("vf", "vs", "specserve.target.verify", 8, 20),
    ]
    if drafting:
        spans += [
            span("pc", "p", "/specserve.v1.DraftService/Propose", 0, 5, "client"),
            span("ps", "pc", "/specserve.v1.DraftService/Propose", 1, 4, "server"),
            span("pf", "ps", "specserve.draft.propose", 1, 3),
        ]
    return spans


def test_the_hop_runs_from_the_drafts_forward_to_the_targets_server() -> None:
    [r] = round_hops(batch_round())
    assert r["round"] == pytest.approx(0.030)
    assert r["hop"] == pytest.approx(0.004)  # 3 ms -> 7 ms
    # still needed when forwarded: the draft server's tail (1 ms) and one one-way
    # trip, half the Verify's 2 ms of transport
    assert r["kept"] == pytest.approx(0.002)
    assert r["saved"] == pytest.approx(0.002)


def test_plain_rounds_have_no_hop() -> None:
    assert round_hops(batch_round(drafting=False)) == []
