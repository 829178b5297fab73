"""bench.device_round starts, times every mode, and counts launches where CUDA runs."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench import device_round


def test_it_times_greedy_and_sampled_rounds_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    rows = device_round.measure(cpu, vocab=256, widths=[1, 3], reps=1)
    assert [(r["sessions"], r["mode"]) for r in rows] == [
        (1, "greedy"),
        (1, "sampled"),
        (3, "greedy"),
        (3, "sampled"),
    ]
    assert all(r["ms_per_round"] > 0 and r["rounds"] >= 1 for r in rows)
    head = device_round.headline(rows, cpu)
    assert head["device"] == "cpu" and set(head["ms_per_round"]["sampled"]) == {"1", "3"}
    assert "launches_per_round" not in head
    args = argparse.Namespace(device="cpu", vocab=256, reps=1)
    assert "| 3 | sampled |" in device_round.report(rows, args, device_round.environment())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_it_counts_kernel_launches() -> None:
    rows = device_round.measure(torch.device("cuda"), vocab=256, widths=[2], reps=1)
    assert all(r["launches_per_round"] > 0 for r in rows)
    assert all(0 < r["device_busy_fraction"] <= 1 for r in rows)


def test_the_profiled_pass_sees_a_few_rounds_then_finishes_the_decode() -> None:
    """On a CPU the profiler records no kernel launches; the pass still decodes to the
    end and releases every session."""
    cpu = torch.device("cpu")
    engine = device_round.make_engine(cpu, vocab=256)
    states = device_round.sessions(2, "sampled", 7)
    counts = device_round.profiled(engine, states, cpu)
    assert counts["launches_per_round"] == 0 and counts["device_busy_fraction"] == 0
    assert all(s.finished for s in states)
    assert engine.verifier.kv.alloc.used_blocks == 0


def test_static_steps_run_the_target_and_say_so() -> None:
    """``--steps static`` (the CUDA graphs' step, launched from the host) on a CPU: the
    target's rounds go through the static step and the rows name it."""
    rows = device_round.measure(torch.device("cpu"), vocab=256, widths=[2], reps=1, steps="static")
    assert {r["steps"] for r in rows} == {"static"}
    assert all(r["static_steps"] > 0 for r in rows)
    engine = device_round.make_engine(torch.device("cpu"), 256, "static", [2])
    drafter = engine.drafters["model"]
    assert drafter.steps is not None  # type: ignore[attr-defined]
