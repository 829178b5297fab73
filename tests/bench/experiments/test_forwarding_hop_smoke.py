"""bench.experiments.forwarding_hop runs end to end on tiny emulated-device models (one sessions
count, one repetition, nothing written) and its headline holds what the decision needs."""

from __future__ import annotations

import pytest

from bench.experiments import forwarding_hop


@pytest.mark.timeout(1800)  # three processes start; minutes on a busy machine
def test_a_short_run_reports_the_hop_beside_the_round() -> None:
    argv = ["--sessions", "1", "--reps", "1", "--new-tokens", "8", "--no-write"]
    data = forwarding_hop.main(argv)
    one = data["headline"]["1"]
    assert set(one) == {"saved_ms", "round_ms", "round_spread_ms"}
    assert one["round_ms"] is not None and one["round_ms"] >= 12.0  # the target's forward
