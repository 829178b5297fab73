"""bench.experiments.quant_prefill runs end to end on the tiny shapes: every variant at every row
count, and a headline per row count."""

from __future__ import annotations

import pytest

from bench.experiments import quant_prefill
from specserve.engine import cpu_kernels


def test_a_small_run_reports_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels are not available here")
    argv = ["--models", "tiny", "--rows", "40", "--reps", "1", "--threads", "1", "--no-write"]
    assert quant_prefill.main(argv) == 0
    md = capsys.readouterr().out
    for variant in ("float32", "float32_whole", "quantized", "quantized_whole"):
        assert f"| tiny | Q8_0 | 40 | {variant} |" in md, md
    assert "| tiny 40 rows |" in md, md
