"""Whether a batch waits its coalescing window: only while waiting brings company.

The model executor may hold a batch for ``window_s`` so that calls arriving just
after it share one forward. Calls that queued while the model thread was busy
join the next batch anyway, without a wait; the window only catches a call that
arrives within ``window_s`` of another one while the thread is idle, i.e. from a
second caller (another orchestrator replica) in step with the first. One
orchestrator sends one call per phase of a round, so on its own every wait is
lost time: up to 2 ms of every ``Propose`` and every ``Verify``, about 1% of a
0.2 s CPU round and a sixth of a 12 ms device forward.

:class:`WindowGate` remembers, for each of its last ``memory`` waits, whether a
call joined the batch during the wait. While one of them caught a call, every
batch waits; otherwise batches start at once, except a probe every
``probe_every`` batches that waits, so a second caller turning up is noticed
within a few batches and the window is back on. A new gate probes its first
batch (callers that start together share it) and has caught nothing else: a lone
caller pays the window on one batch in ``probe_every``, no more. Company that
queued while the thread was busy says nothing about the window (it joins without
one) and is not counted.
"""

from __future__ import annotations

import collections


class WindowGate:
    """Decides per batch whether to wait; told after each wait whether it caught a call."""

    def __init__(self, *, memory: int = 32, probe_every: int = 16) -> None:
        if memory < 1 or probe_every < 1:
            raise ValueError(f"memory and probe_every must be >= 1, got {memory}, {probe_every}")
        self.probe_every = probe_every
        self._caught: collections.deque[bool] = collections.deque(maxlen=memory)
        self._skipped = probe_every - 1  # batches started at once since the last wait

    @property
    def open(self) -> bool:
        """True while waiting pays: one of the remembered waits caught a call."""
        return any(self._caught)

    def should_wait(self) -> bool:
        """Whether the batch about to start should wait its window (counts skips)."""
        if self.open or self._skipped + 1 >= self.probe_every:
            self._skipped = 0
            return True
        self._skipped += 1
        return False

    def waited(self, caught: bool) -> None:
        """A batch waited its window; ``caught``: a call joined it during the wait."""
        self._caught.append(caught)
