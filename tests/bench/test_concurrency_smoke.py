"""bench.concurrency runs end to end on tiny models (two session counts, few tokens,
nothing written): the stack, the local loop and the ratios the results carry."""

from __future__ import annotations

import pytest

from bench import concurrency
from bench.concurrency_report import ADAPTIVE, PLAIN


@pytest.mark.timeout(1800)  # three processes and a local loop start; minutes on a busy machine
def test_a_short_run_measures_adaptive_against_plain_and_the_local_loop() -> None:
    argv = ["--target", "tiny:3", "--draft", "tiny:3:noise=0.05", "--draft-dtype", "float32"]
    argv += ["--concurrency", "1,2", "--reps", "1", "--new-tokens", "16", "--threads", "1"]
    data = concurrency.main([*argv, "--no-write"])
    headline = data["headline"]
    assert set(headline["adaptive_over_plain"]) == {1, 2}
    assert all(r > 0 for r in headline["adaptive_over_plain"].values())
    assert headline["stack_over_local"] > 0
    rows = {(r["variant"], r["concurrency"]): r for r in data["summary"]["stack"]}
    assert set(rows) == {(v, c) for v in (PLAIN, ADAPTIVE) for c in (1, 2)}
    for (_, sessions), row in rows.items():
        assert row["streams"] == sessions and row["tokens_per_s"] > 0
        assert row["wrong_streams"] == 0  # greedy: adaptive's tokens are plain's
    assert data["local"], "the local loop ran"
