"""bench.experiments.orchestrator_profile runs end to end on tiny emulated-device models (one
sessions count, one repetition, nothing written); its headline is CPU and wall per round."""

from __future__ import annotations

import pytest

from bench.experiments import orchestrator_profile


@pytest.mark.timeout(1800)  # two servers and a Redis start; minutes on a busy machine
def test_a_short_run_profiles_the_orchestrators_rounds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--sessions", "1", "--reps", "1", "--new-tokens", "8", "--top", "3", "--no-write"]
    assert orchestrator_profile.main(argv) == 0
    assert "process CPU" in capsys.readouterr().out


def test_the_headline_is_each_sessions_counts_time_per_round() -> None:
    row = {"process_cpu_ms_per_round": 2.0, "loop_cpu_ms_per_round": 1.5, "wall_ms_per_round": 17}
    results = {"8": {**row, "rounds": 40, "top": []}}
    assert orchestrator_profile.headline(results) == {"8": row}
