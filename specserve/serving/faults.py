"""Fault injection for tests: make a model fail the way a lost GPU does.

``--fail-after-forwards N`` on a server arms :func:`fail_after_forwards`: the
model's forward raises ``RuntimeError`` from the (N+1)-th call on, an untyped
exception from inside the model executor, which is what a CUDA error looks like
to the server. The server must answer INTERNAL, turn health NOT_SERVING and refuse
further model calls with UNAVAILABLE.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class SimulatedDeviceFailure(RuntimeError):
    """Raised by a model armed with :func:`fail_after_forwards`."""


def fail_after_forwards(model: nn.Module, forwards: int) -> None:
    """Let ``model`` run ``forwards`` forward calls, then raise on every later one."""
    assert forwards >= 0
    calls = [0]

    def hook(module: nn.Module, args: Any) -> None:
        calls[0] += 1
        if calls[0] > forwards:
            raise SimulatedDeviceFailure(
                f"simulated device failure on forward {calls[0]} (injected after {forwards})"
            )

    model.register_forward_pre_hook(hook)
