"""bench.experiments.http_overhead starts its stack, streams through both paths and prints
its table."""

from __future__ import annotations

import pytest

from bench.experiments import http_overhead


def test_a_short_run_measures_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--tokens", "8", "--reps", "1", "--warmup", "0", "--concurrency", "1,2", "--no-write"]
    assert http_overhead.main(argv) == 0
    md = capsys.readouterr().out
    assert "\n| 1 | " in md and "\n| 2 | " in md  # a row per concurrency
    assert "added ms/token" in md
