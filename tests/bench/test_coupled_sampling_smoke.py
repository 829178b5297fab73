"""bench.coupled_sampling runs end to end on tiny models (nothing written).

The coupled variants must reproduce target-only's tokens there too, and the headline
must carry the speed ratios."""

from __future__ import annotations

import pytest

from bench import coupled_sampling


def test_a_short_run_compares_the_rules_and_reports_the_headline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        *("--target", "tiny:3", "--draft", "tiny:3:noise=0.3", "--draft-dtype", "float32"),
        *("--prompts", "0-0", "--prose", "1", "--new-tokens", "10", "--temperatures", "0.7,1.0"),
        *("--ks", "3,auto", "--sampler-rows", "2", "--threads", "1", "--no-write"),
    ]
    assert coupled_sampling.main(argv) == 0
    md = capsys.readouterr().out
    for t in ("0.7", "1.0"):
        for k in ("3", "auto"):
            assert f"- t={t} k={k}: coupled / rejection speed: **" in md
            assert f"| {t} | coupled k={k} |" in md and f"| {t} | rejection k={k} |" in md
    coupled_rows = [line for line in md.splitlines() if "| coupled k=" in line]
    assert len(coupled_rows) == 4 and all(line.endswith("| none |") for line in coupled_rows)
    assert "Sampler cost per verified position" in md
