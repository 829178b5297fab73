"""The model thread's progress counter: how an orchestrator tells a hung replica from a slow one.

The counter goes up as the model thread works: once per finished batch, and
once per decoder layer of every forward on a backend that names its layers
(``progress_modules()``), so a long prefill moves it many times a second. The
servers report it, with whether the thread holds work, in ``GetLoad``
(``LoadReport.progress_steps`` and ``busy``). A counter that stands still while
the replica holds work means the thread is stuck (a hung device, a deadlock); a
replica that does not answer at all (stopped, partitioned) is stuck too. Only
the model thread writes the counter; readers on the event loop see a recent
value (a plain int: reads and writes are atomic under the GIL).

The counter alone cannot tell a hung thread from one on a host so busy that a
layer takes longer than the stall time, so the servers also report the model
thread's CPU time (``LoadReport.model_cpu_ns``, read from the thread's own CPU
clock by any thread): a thread that still gets CPU time is slow, not hung.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any


class ModelProgress:
    """A counter the model thread bumps as it works, and that thread's CPU clock."""

    def __init__(self) -> None:
        self.steps = 0
        self._clock: int | None = None  # the model thread's CPU-time clock id

    def attach_thread(self) -> None:
        """Called on the model thread: :meth:`cpu_ns` reports this thread from now on."""
        try:
            self._clock = time.pthread_getcpuclockid(threading.get_ident())
        except (AttributeError, OSError):  # no per-thread CPU clocks here: not reported
            self._clock = None

    def cpu_ns(self) -> int:
        """CPU time the model thread has consumed (ns); 0 when unknown (not attached,
        no per-thread clocks, or the thread has ended)."""
        if self._clock is None:
            return 0
        try:
            return time.clock_gettime_ns(self._clock)
        except OSError:  # the thread ended
            return 0

    def step(self, *_: object) -> None:
        """One more piece of work done (also usable as a torch forward hook)."""
        self.steps += 1

    def watch(self, modules: Iterable[Any]) -> None:
        """Count every forward of each module (torch ``nn.Module``: decoder layers).

        Each module's ``forward`` is wrapped rather than given a forward hook: a module
        with a hook leaves torch's fast call path, which costs a few microseconds per
        call, once per layer of every forward (a decode step's host time).
        """
        for module in modules:
            module.forward = _counted(module.forward, self)


def _counted(forward: Callable[..., Any], progress: ModelProgress) -> Callable[..., Any]:
    """``forward``, then one more step on ``progress``."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        progress.steps += 1
        return out

    return counted
