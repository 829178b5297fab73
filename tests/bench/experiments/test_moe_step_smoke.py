"""bench.experiments.moe_step runs end to end on the tiny pair: a line per row count."""

from __future__ import annotations

import pytest

from bench.experiments import moe_step


def test_a_small_run_reports_both_row_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert moe_step.main(["--shapes", "tiny", "--steps", "2", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("shape  rows")
    assert [line.split()[:2] for line in lines[1:]] == [["tiny", "1"], ["tiny", "5"]]
