"""bench.device_shapes runs end to end on the tiny shape on a CPU: every row count of the
target and the draft's step, each beside the floor its copy bandwidth implies."""

from __future__ import annotations

import pytest

from bench import device_shapes


def test_a_tiny_run_reports_every_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--device", "cpu", "--target", "tiny", "--draft", "tiny", "--dtype", "float32",
            "--rows", "1-3", "--sessions", "1,2", "--context", "64", "--cached", "8",
            "--kv-mib", "4", "--stream-mib", "8", "--reps", "2", "--no-write"]  # fmt: skip
    assert device_shapes.main(argv) == 0
    md = capsys.readouterr().out
    lines = [x for x in md.splitlines() if x.startswith("| tiny |")]
    assert len(lines) == 2 * 3 + 2  # target: 2 session counts x 3 row counts; draft: 1 row each
    for line in lines:
        ms, no_graph, floor, x_floor, x_one = (float(v) for v in line.split("|")[4:9])
        assert min(ms, no_graph, floor, x_floor, x_one) > 0, line
    assert "launched from the host" in md  # no CUDA graphs on a CPU


def test_the_headline_holds_the_issues_figures_at_one_session() -> None:
    args = device_shapes.argparse.Namespace(target="big", draft="small")
    row = {"sessions": 1, "x_floor": 1.2, "x_one_row": 1.0}
    rows = [
        {**row, "model": "big", "rows": 1},
        {**row, "model": "big", "rows": 5, "x_one_row": 1.1},
        {**row, "model": "big", "rows": 5, "sessions": 8, "x_one_row": 3.0},
        {**row, "model": "small", "rows": 1, "x_floor": 2.0},
    ]
    h = device_shapes.headline(rows, args)
    assert h["target_step_over_floor"] == 1.2 and h["draft_step_over_floor"] == 2.0
    assert h["verify_rows_over_one"] == {"5": 1.1}


def test_the_real_shapes_are_qwen25s() -> None:
    seven, half = device_shapes.SHAPES["qwen2.5-7b"], device_shapes.SHAPES["qwen2.5-0.5b"]
    assert (seven.hidden_size, seven.num_layers, seven.num_kv_heads) == (3584, 28, 4)
    assert (half.hidden_size, half.num_layers, half.tie_word_embeddings) == (896, 24, True)
