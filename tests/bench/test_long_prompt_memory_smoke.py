"""bench.long_prompt_memory runs end to end on a tiny model (two lengths, chunked and not)."""

from __future__ import annotations

import pytest

from bench import long_prompt_memory


def test_a_short_run_reports_every_length_and_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--tokens", "300,700", "--chunks", "0,256", "--threads", "1", "--no-write"]
    assert long_prompt_memory.main(argv) == 0
    md = capsys.readouterr().out
    for row in ("| 300 | off |", "| 300 | 256 |", "| 700 | off |", "| 700 | 256 |"):
        assert row in md, md
    assert "failed" not in md


def test_under_a_memory_cap_only_the_chunked_prefill_of_20k_tokens_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One forward over 20,000 tokens asks for gigabytes (a [20k x 20k] mask and scores):
    the 1.5 GiB cap turns that into a reported failure; in chunks of 512 it runs."""
    argv = ["--tokens", "20000", "--chunks", "0,512", "--threads", "1", "--max-gib", "1.5"]
    assert long_prompt_memory.main([*argv, "--no-write"]) == 0
    md = capsys.readouterr().out
    assert "| 20000 | off | - | failed" in md
    assert "| 20000 | 512 | " in md and md.count("failed") == 1
