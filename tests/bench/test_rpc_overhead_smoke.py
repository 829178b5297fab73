"""bench.rpc_overhead runs end to end on its stub servers (a few rounds, nothing written).

The stub backends stand in for the real ones, so a change to what the servicers ask
of a backend shows up here rather than as a crash of the benchmark."""

from __future__ import annotations

import pytest

from bench import rpc_overhead


def test_a_short_run_measures_every_batch_size_and_the_references(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--models", "stub", "--rounds", "3", "--warmup", "1", "--no-write"]
    assert rpc_overhead.main(argv) == 0
    md = capsys.readouterr().out
    for batch in rpc_overhead.BATCHES:
        assert f"\n| {batch} | **" in md  # a row with a round p50 per batch size
    assert "bare grpc.aio server" in md and "`GetLoad`" in md
