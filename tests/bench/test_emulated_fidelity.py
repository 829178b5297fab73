"""bench.emulated_fidelity: the tiny models' CPU per forward, and where it passes the
device time an emulated forward stands for."""

from __future__ import annotations

from bench.emulated_fidelity import cpu_bound, prefill_cpu_ms

CPU_MS = {
    "draft_step": {1: 0.4, 32: 1.8},
    "target_verify": {1: 0.6, 32: 6.1},
    "target_step": {1: 0.4, 32: 1.7},
}


def test_a_forward_whose_cpu_passes_its_models_device_time_is_named() -> None:
    assert cpu_bound(CPU_MS, 2, 12) == []
    assert cpu_bound(CPU_MS, 1, 6) == [
        "draft step at 32 sessions: 1.80 ms of CPU > 1 ms",
        "target verify at 32 sessions: 6.10 ms of CPU > 6 ms",
    ]
    assert len(cpu_bound(CPU_MS, 0, 0)) == 6  # no device time: every forward is the CPU's
    prefill = {"draft_prefill": 3.3, "target_prefill": 3.3, "tokens": 256}
    assert cpu_bound(CPU_MS, 2, 12, prefill) == ["draft prefill of a prompt: 3.30 ms of CPU > 2 ms"]


def test_a_prompts_prefill_is_timed_on_both_models_and_grows_with_the_prompt() -> None:
    models = {
        "target": "tiny:3",
        "draft": "tiny:3:noise=0.05",
        "target_dtype": "float32",
        "draft_dtype": "float32",
        "threads": 1,
    }
    short = prefill_cpu_ms(models, [[i % 200 + 1 for i in range(16)]] * 3)
    long = prefill_cpu_ms(models, [[i % 200 + 1 for i in range(600)]] * 3)
    assert short["tokens"] == 16 and long["tokens"] == 600
    for kind in ("draft_prefill", "target_prefill"):
        assert 0 < short[kind] < long[kind]
