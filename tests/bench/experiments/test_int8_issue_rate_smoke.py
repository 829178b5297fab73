"""bench.experiments.int8_issue_rate runs end to end with short loops: the clock, the
three assembly loops and each kernel row count, with rates that are positive."""

from __future__ import annotations

import platform
import re
import shutil

import pytest

from bench.experiments import int8_issue_rate
from specserve.engine import cpu_kernels


def test_a_short_run_prints_the_loops_and_the_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    if platform.machine() != "x86_64" or shutil.which("c++") is None:
        pytest.skip("needs an x86-64 CPU and a C++ compiler")
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels are not available here")
    argv = ["--iterations", "200000", "--max-rows", "2", "--reps", "2"]
    assert int8_issue_rate.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"clock \(dependent adds\): \d+\.\d\d GHz", out), out
    for loop in int8_issue_rate._LOOPS:
        assert re.search(rf"\| {re.escape(loop)} \| \d+\.\d\d \| \d+\.\d \|", out), loop
    for kind in ("Q4_K", "Q6_K"):
        for rows in (1, 2):
            row = re.search(rf"\| {kind} x8 \| {rows} \| (\d+\.\d) \| (\d+\.\d\d) \|", out)
            assert row is not None and float(row[1]) > 0, (kind, rows, out)
