"""bench.k_policy_replay: the replay's round accounting on made-up sequences, and a
small run on tiny models that measures, replays every policy and replays again from
its saved JSON to the same figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import k_policy_replay as replay
from specserve.policy.k_policy import KPolicy

COSTS = replay.Costs(
    target={r: 40.0 + 5.0 * (r - 1) for r in range(1, 10)},
    draft={r: 10.0 + 1.0 * (r - 1) for r in range(1, 10)},
    overhead=2.0,
)


def _seq(match: list[int], conf: float) -> dict[str, object]:
    return {"label": "made up", "match": match, "conf": [conf] * len(match)}


def test_the_oracle_drafts_each_run_of_matches_and_a_round_costs_its_forwards() -> None:
    out = replay.replay(_seq([1] * 18, 0.99), None, "product", COSTS)
    assert out["rounds"] == 2 and out["drafted"] == 16  # 8 kept + a bonus, twice
    # A round: the overhead, 8 draft forwards (the first feeds 1 unseen token; the second
    # round's 2: the last draft and the bonus), the target's 9 rows.
    first = 2.0 + 10.0 * 8 + 80.0
    assert out["ms"] == pytest.approx(first + first + 1.0)


def test_a_fixed_k_is_drafted_whole_and_a_sure_wrong_draft_loses_every_draft() -> None:
    out = replay.replay(_seq([0] * 10, 0.99), KPolicy(3), "product", COSTS)
    # k shrinks to the tokens left after it: 2, 1, then a plain last round
    assert out["rounds"] == 10 and out["drafted"] == 3 * 7 + 2 + 1


def test_the_depth_floor_stops_an_unsure_draft_after_its_first_and_plain_rounds_follow() -> None:
    unsure = replay.replay(_seq([0] * 64, 0.3), KPolicy(None), "product", COSTS)
    assert unsure["drafted"] < unsure["rounds"]  # at most one a round, then none
    sure = replay.replay(_seq([1] * 64, 0.999), KPolicy(None), "product", COSTS)
    assert sure["drafted"] / sure["rounds"] > 6  # deep rounds where the draft is sure


def test_a_small_run_replays_every_policy_and_again_from_its_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(replay, "write_results", _write_to(tmp_path))
    argv = ["--tiny", "--prompts", "0-1", "--prose", "0", "--new-tokens", "16", "--reps", "1"]
    replay.main(argv)
    first = capsys.readouterr().out
    for name in replay.policies():
        assert f"| {name} |" in first, name
    saved = json.loads((tmp_path / "k_policy_replay.json").read_text())
    assert set(saved["headline"]) >= {"adaptive_vs_target_only", "oracle_vs_target_only"}
    assert len(saved["data"]["sequences"]) == 2
    replay.main(["--replay", str(tmp_path / "k_policy_replay.json"), "--no-write"])
    again = capsys.readouterr().out
    table = [line for line in first.splitlines() if line.startswith("| ")]
    assert table == [line for line in again.splitlines() if line.startswith("| ")]


def _write_to(folder: Path):  # type: ignore[no-untyped-def]
    def write(name: str, markdown: str, data: dict[str, object]) -> None:
        (folder / f"{name}.md").write_text(markdown)
        (folder / f"{name}.json").write_text(json.dumps(data))

    return write
