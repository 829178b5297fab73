"""A decode round's spans split into device, transport, servers, store and orchestrator,
on a hand-built trace (no processes): the parts add up to the round, and a commit that
runs on past its round counts only inside it."""

from __future__ import annotations

import pytest

from bench.emulated_gpu_phases import decode_rounds
from specserve.telemetry.receiver import ReceivedSpan

MS = 1_000_000  # ns


def span(
    sid: str, parent: str, name: str, start: int, end: int, kind: str = "internal"
) -> ReceivedSpan:
    return ReceivedSpan("t" * 32, sid, parent, name, kind, start * MS, end * MS, {}, {})


def round_trace(commit_end_ms: int) -> list[ReceivedSpan]:
    """A 30 ms round: Propose 0-5 (server 1-4, forward 1.5-3.5), Verify 6-22 (server 7-21,
    forward 8-20), commit from 24 to ``commit_end_ms``."""
    return [
        span("r", "req", "specserve.round", 0, 30),
        span("p", "r", "specserve.propose", 0, 5),
        span("pc", "p", "/specserve.v1.DraftService/Propose", 0, 5, "client"),
        span("ps", "pc", "/specserve.v1.DraftService/Propose", 1, 4, "server"),
        span("pf", "ps", "specserve.draft.propose", 1, 3),
        span("v", "r", "specserve.verify", 6, 22),
        span("vc", "v", "/specserve.v1.TargetService/Verify", 6, 22, "client"),
        span("vs", "vc", "/specserve.v1.TargetService/Verify", 7, 21, "server"),
        span("vf", "vs", "specserve.target.verify", 8, 20),
        span("c", "r", "specserve.commit", 24, commit_end_ms),
    ]


def test_the_parts_of_a_round_add_up_to_it() -> None:
    [parts] = decode_rounds(round_trace(commit_end_ms=28))
    assert parts["round"] == pytest.approx(0.030)
    assert parts["device"] == pytest.approx(0.002 + 0.012)
    assert parts["servers"] == pytest.approx(0.001 + 0.002)
    assert parts["transport"] == pytest.approx(0.002 + 0.002)
    assert parts["store"] == pytest.approx(0.004)
    assert parts["orchestrator"] == pytest.approx(0.030 - 0.014 - 0.003 - 0.004 - 0.004)


def test_a_commit_overlapping_the_next_round_counts_only_inside_its_own() -> None:
    [parts] = decode_rounds(round_trace(commit_end_ms=40))
    assert parts["store"] == pytest.approx(0.006)  # 24-30, not 24-40
    assert parts["orchestrator"] >= 0
    total = sum(v for k, v in parts.items() if k != "round")
    assert total == pytest.approx(parts["round"])
