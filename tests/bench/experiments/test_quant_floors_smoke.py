"""bench.experiments.quant_floors runs end to end on a small shape: each cell beside its three
floors; and one step of the target counts the Q4_K_M products it runs."""

from __future__ import annotations

import pytest

from bench.experiments import quant_floors
from specserve.engine import cpu_kernels


def test_a_step_runs_seven_products_a_layer_and_the_lm_head() -> None:
    count = quant_floors.step_products(28)
    assert sum(count.values()) == 28 * 7 + 1
    assert count["k/v", "Q6_K"] == count["down", "Q6_K"] == 14  # v and down, 14 layers
    assert count["lm_head", "Q6_K"] == 1 and count["gate/up", "Q4_K"] == 56


def test_a_small_run_reports_every_cell_and_the_floors(capsys: pytest.CaptureFixture[str]) -> None:
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels are not available here")
    argv = ["--shapes", "tiny", "--types", "Q4_K,Q8_0", "--rows", "1,2", "--reps", "1",
            "--threads", "1", "--pool-mib", "1", "--stream-mib", "16", "--gemm-n", "128",
            "--hot-kib", "16", "--hot-repeat", "2"]  # fmt: skip
    assert quant_floors.main(argv) == 0
    md = capsys.readouterr().out
    assert "GB/s" in md and "multiply-adds/s" in md, md
    lines = md.splitlines()
    for kind in ("Q4_K", "Q8_0"):
        for rows in (1, 2):
            line = next(x for x in lines if x.startswith(f"| tiny 64x512 | {kind} | {rows} |"))
            ms, memory, fma, hot, bound = (float(v) for v in line.split("|")[4:9])
            assert ms > 0 and bound > 0 and min(memory, fma, hot) >= 0, line
