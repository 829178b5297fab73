"""bench.experiments.quant_matmul runs end to end on small shapes: every weight kind at every row
count, and a headline per type."""

from __future__ import annotations

import pytest

from bench.experiments import quant_matmul
from specserve.engine import cpu_kernels


def test_a_small_run_reports_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels are not available here")
    argv = ["--models", "tiny", "--rows", "1,3", "--reps", "1", "--threads", "1"]
    assert quant_matmul.main([*argv, "--pool-mib", "1", "--no-write"]) == 0
    md = capsys.readouterr().out
    for kind in ("float32", "bfloat16", "Q4_K", "Q6_K", "Q5_0", "Q8_0"):
        assert f"| tiny | q/o 64x256 | 3 | {kind} |" in md, md
        assert f"| tiny | {kind} |" in md, md
