"""The model thread's progress counter: how an orchestrator tells a hung replica from a slow one.

The counter goes up as the model thread works: once per finished batch, and
once per attention layer of every forward on a backend that names its layers
(``progress_modules()``), so a long prefill moves it many times a second. The
servers report it, with whether the thread holds work, in ``GetLoad``
(``LoadReport.progress_steps`` and ``busy``). A counter that stands still while
the replica holds work means the thread is stuck (a hung device, a deadlock); a
replica that does not answer at all (stopped, partitioned) is stuck too. Only
the model thread writes the counter; readers on the event loop see a recent
value (a plain int: reads and writes are atomic under the GIL).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ModelProgress:
    """A counter the model thread bumps as it works."""

    def __init__(self) -> None:
        self.steps = 0
        self._hooks: list[Any] = []

    def step(self, *_: object) -> None:
        """One more piece of work done (also usable as a torch forward hook)."""
        self.steps += 1

    def watch(self, modules: Iterable[Any]) -> None:
        """Count every forward of each module (torch ``nn.Module``: attention layers)."""
        for module in modules:
            self._hooks.append(module.register_forward_hook(self.step))
