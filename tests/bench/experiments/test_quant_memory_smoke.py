"""bench.experiments.quant_memory runs end to end on a tiny synthetic model (every stage reported,
and the model holds its blocks, a tied head once, plus float32 vectors) and on the
servers of the tiny pair (each server's resident set, once serving and after a request)."""

from __future__ import annotations

import pytest

from bench.experiments import quant_memory


def test_a_tiny_run_reports_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tiny", "--kv-budget", "4MiB", "--prompt", "40", "--steps", "2"]
    assert quant_memory.main([*argv, "--threads", "1", "--no-write"]) == 0
    md = capsys.readouterr().out
    for stage in ("start", "weights loaded", "KV pool", "prefill of 40 tokens", "2 one-token"):
        assert f"| {stage}" in md, md
    assert "Held by the model: 0.00" in md, md


@pytest.mark.timeout(1800)  # three processes start; minutes on a busy machine
def test_the_servers_of_the_tiny_pair_report_their_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--servers", "--tiny", "--new-tokens", "8", "--threads", "1", "--no-write"]
    assert quant_memory.main(argv) == 0
    md = capsys.readouterr().out
    rows = [line for line in md.splitlines() if line.startswith("| serving |")]
    rows += [line for line in md.splitlines() if line.startswith("| after a request of 8 tokens |")]
    assert [r.split("|")[2].strip() for r in rows] == ["target", "draft", "target", "draft"], md
    for row in rows:  # resident, anonymous, mapped files, peak: a loaded server holds some
        resident, anonymous, files, peak = (float(v) for v in row.split("|")[3:7])
        assert 0 < resident <= peak and anonymous + files <= resident + 0.01, row


def test_the_servers_headline_is_the_last_stage_of_each_server() -> None:
    mem = {"rss_gib": 1.0, "anon_gib": 0.9, "file_gib": 0.1, "peak_gib": 1.5}
    served = {
        "stages": [
            {"stage": "serving", "target": {**mem, "rss_gib": 0.5}, "draft": mem},
            {"stage": "after", "target": {**mem, "rss_gib": 3.5}, "draft": {**mem, "peak_gib": 2}},
        ]
    }
    assert quant_memory.servers_headline(served) == {
        "target_rss_gib": 3.5,
        "target_peak_gib": 1.5,
        "draft_rss_gib": 1.0,
        "draft_peak_gib": 2,
    }
