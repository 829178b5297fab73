"""bench.emulated_fidelity: the tiny models' own time per forward (CPU, or the real
forward on a GPU), and where it passes the device time an emulated forward stands for."""

from __future__ import annotations

import pytest
import torch

from bench.emulated_fidelity import cpu_bound, prefill_cpu_ms
from bench.emulated_gpu_report import fidelity_section

MODELS = {
    "target": "tiny:3",
    "draft": "tiny:3:noise=0.05",
    "target_dtype": "float32",
    "draft_dtype": "float32",
    "threads": 1,
}

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


def test_on_a_gpu_the_sentences_say_what_was_timed() -> None:
    """With the models on a GPU the times are the real forwards there, not CPU time."""
    assert cpu_bound(CPU_MS, 1, 6, device="cuda") == [
        "draft step at 32 sessions: 1.80 ms on cuda > 1 ms",
        "target verify at 32 sessions: 6.10 ms on cuda > 6 ms",
    ]
    fidelity = {"device": "cuda", "cpu_ms": CPU_MS, "cpu_bound": {"1/6": ["x"], "2/12": []}}
    text = "\n".join(fidelity_section(fidelity))
    assert "own time on cuda" in text and "synchronised" in text and "of CPU" not in text
    assert "- 2/12: every forward's time on cuda stays under its device time." in text
    cpu = "\n".join(fidelity_section({**fidelity, "device": "cpu"}))
    assert "own CPU time" in cpu and "synchronised" not in cpu


def _prefill_grows_with_the_prompt(device: str) -> None:
    short = prefill_cpu_ms(MODELS, [[i % 200 + 1 for i in range(16)]] * 3, device)
    long = prefill_cpu_ms(MODELS, [[i % 200 + 1 for i in range(600)]] * 3, device)
    assert short["tokens"] == 16 and long["tokens"] == 600
    for kind in ("draft_prefill", "target_prefill"):
        assert 0 < short[kind] < long[kind]


def test_a_prompts_prefill_is_timed_on_both_models_and_grows_with_the_prompt() -> None:
    _prefill_grows_with_the_prompt("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_prefill_is_timed_on_the_device() -> None:
    _prefill_grows_with_the_prompt("cuda")
