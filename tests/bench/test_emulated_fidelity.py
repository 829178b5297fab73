"""bench.emulated_fidelity: the tiny models' CPU per forward, and where it passes the
device time an emulated forward stands for."""

from __future__ import annotations

from bench.emulated_fidelity import cpu_bound

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
