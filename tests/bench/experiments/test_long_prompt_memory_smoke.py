"""bench.experiments.long_prompt_memory runs end to end on a tiny model: every length and chunk size
gets its row, and under a memory cap only the chunked prefill of 10k tokens runs."""

from __future__ import annotations

import pytest

from bench.experiments import long_prompt_memory


def test_every_length_and_chunk_is_reported_and_only_the_chunked_10k_prefill_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two lengths by two chunk sizes, one child process each (four in all: every child
    imports torch, so the short length rides along with the long one instead of a run
    of its own). One forward over 10,000 tokens asks for gigabytes (a [10k x 10k] mask
    and the heads' scores), past the 1.5 GiB cap on the child's address space (a torch
    process maps over a GiB before it computes anything): a reported failure; in chunks
    of 512 it runs (the chunked prefill's time grows with the square of the length:
    10k, not 20k, keeps it to seconds). The 300-token prompt fits either way (a chunk
    longer than the prompt is one forward), so exactly one row fails."""
    argv = ["--tokens", "300,10000", "--chunks", "0,512", "--threads", "1", "--max-gib", "1.5"]
    assert long_prompt_memory.main([*argv, "--no-write"]) == 0
    md = capsys.readouterr().out
    for row in ("| 300 | off |", "| 300 | 512 |", "| 10000 | off |", "| 10000 | 512 |"):
        assert row in md, md
    assert "| 10000 | off | - | failed" in md
    assert md.count("failed") == 1, md
