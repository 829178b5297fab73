"""bench.quant_memory runs end to end on a tiny synthetic model: every stage reported,
and the model holds its blocks (a tied head once) plus float32 vectors."""

from __future__ import annotations

import pytest

from bench import quant_memory


def test_a_tiny_run_reports_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tiny", "--kv-budget", "4MiB", "--prompt", "40", "--steps", "2"]
    assert quant_memory.main([*argv, "--threads", "1", "--no-write"]) == 0
    md = capsys.readouterr().out
    for stage in ("start", "weights loaded", "KV pool", "prefill of 40 tokens", "2 one-token"):
        assert f"| {stage}" in md, md
    assert "Held by the model: 0.00" in md, md
