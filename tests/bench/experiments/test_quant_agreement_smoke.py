"""bench.experiments.quant_agreement starts and measures on a tiny GGUF file: both forms load, the
figures are in range and not trivially equal (the 8-bit activations round)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.experiments import quant_agreement
from tests.support.tiny_gguf import write_tiny_gguf


def test_a_tiny_file_is_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    argv = ["--model", str(path), "--humaneval", "", "--prose", "0", "--tokens", "48"]
    assert quant_agreement.main([*argv, "--threads", "1", "--no-write"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| all |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    tokens, top1, max_abs = int(cells[1]), float(cells[2]), float(cells[3])
    assert tokens == 47 and 0.5 <= top1 <= 1.0 and 0.0 < max_abs < 1.0
