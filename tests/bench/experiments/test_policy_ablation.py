"""bench.experiments.policy_ablation: its arithmetic on made-up runs, its refusal of variants the
orchestrator cannot run, and a short run end to end on tiny models (results in a
temporary folder), so that the benchmark keeps starting."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import common
from bench.experiments import policy_ablation
from bench.experiments.policy_ablation import VARIANTS, Variant, fixed_k_variants, unsupported
from bench.experiments.policy_ablation_report import summarize, verdict
from bench.serving_stack import Run, Stream, declared_devices


def run(variant: str, c: int, rep: int, wall: float, tokens: list[int]) -> Run:
    streams = [Stream(0.0, [(0.1, 1), (wall, len(tokens) - 1)], tokens, "length", 4, 3, 2)]
    return Run(variant, c, rep, wall, streams * c)


def test_verdict_needs_every_repetition_on_one_side() -> None:
    assert verdict([1.1, 1.2, 1.05]) == "faster"
    assert verdict([0.9, 0.95]) == "slower"
    assert verdict([0.9, 1.1, 1.0]) == "within spread"
    assert verdict([1.5]) == "one rep"


def test_headline_ratios_spread_best_fixed_k_and_wrong_variants() -> None:
    same, other = [1, 2, 3, 4], [1, 2, 9, 4]
    table = {
        **VARIANTS,
        **fixed_k_variants([2, 4]),
        "alpha": Variant("x", policy={"alpha0": "0.6"}),
    }
    variants = {n: table[n] for n in ("plain", "default", "k=2", "k=4", "alpha")}
    runs = []
    for rep in range(3):
        runs += [
            run("plain", 1, rep, 2.0, same),
            run("default", 1, rep, 1.0 + 0.1 * rep, same),  # ~2x plain
            run("k=2", 1, rep, 1.6, same),
            run("k=4", 1, rep, 1.25, same),  # the best fixed k
            run("alpha", 1, rep, [0.9, 1.2, 1.3][rep], other if rep == 2 else same),
        ]
    summary = summarize(runs, variants)
    h = summary["headline"]
    default = h["variants"]["default"][1]
    assert default["ratio_vs_plain"] == pytest.approx(2.0 / 1.1)  # the median repetition
    assert default["ratios_by_rep"] == pytest.approx([2.0, 2.0 / 1.1, 2.0 / 1.2])
    assert default["spread"] == pytest.approx((4 / 1.0 - 4 / 1.2) / (4 / 1.1))
    assert default["vs_default"] is None
    assert h["best_fixed_k"][1]["variant"] == "k=4"
    assert h["default_vs_best_fixed_k"][1] == pytest.approx(1.25 / 1.1)
    assert h["default_never_worse_than_plain"]
    alpha = h["variants"]["alpha"][1]["vs_default"]
    assert alpha["by_rep"] == pytest.approx([1.0 / 0.9, 1.1 / 1.2, 1.2 / 1.3])
    assert alpha["verdict"] == "within spread"
    assert h["variants"]["k=2"][1]["vs_default"]["verdict"] == "slower"
    assert h["wrong_variants"] == ["alpha"]  # one stream differed from plain's


def test_a_variant_needing_a_missing_policy_field_is_refused() -> None:
    variants = {"x": Variant("x", policy={"alpha0": "0.6", "no_such_field": "1"})}
    (sentence,) = unsupported(variants, {"alpha0", "k_max"})
    assert "x needs no_such_field" in sentence
    (sentence,) = unsupported(variants, None)
    assert "has no PolicyConfig" in sentence
    assert unsupported({"plain": VARIANTS["plain"]}, None) == []


def test_a_short_run_on_tiny_models_writes_the_headline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    argv = [
        *("--tiny", "--threads", "1", "--sessions", "1,2", "--reps", "1"),
        *("--new-tokens", "6", "--variants", "plain,default", "--name", "ablation-smoke"),
    ]
    assert policy_ablation.main(argv) == 0  # no variant's tokens differ from plain's
    md = capsys.readouterr().out
    for c in (1, 2):
        assert f"| {c} | plain |" in md and f"| {c} | default |" in md
    data = json.loads((tmp_path / "ablation-smoke.json").read_text())
    h = data["headline"]
    assert set(h["variants"]) == {"plain", "default"}
    assert set(h["variants"]["default"]) == {"1", "2"}
    assert h["wrong_variants"] == []
    assert data["environment"]["cpu_flags"] and "policy_ablation" in data["environment"]["command"]
    assert (tmp_path / "ablation-smoke.md").read_text().startswith("# Policy ablation")


def test_the_stack_declares_shared_devices_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SPECSERVE_DEVICES", raising=False)
    assert declared_devices(argparse.Namespace(emulate_devices=None)) == "shared"
    assert declared_devices(argparse.Namespace(emulate_devices=(2.0, 12.0))) == "separate"
    monkeypatch.setenv("SPECSERVE_DEVICES", "separate")
    assert declared_devices(argparse.Namespace(emulate_devices=None)) == "separate"
