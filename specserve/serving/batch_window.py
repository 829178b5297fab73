"""Whether a batch waits its coalescing window: only where waiting has brought company.

The model executor may hold a batch for ``window_s`` so that calls arriving just
after it share one forward. Calls that queued while the model thread was busy
join the next batch anyway; the window only catches a call that arrives within
``window_s`` of another one while the thread is idle, i.e. from a second caller
(another orchestrator replica) in step with the first. One orchestrator sends
one call per phase of a round, so on its own every wait is lost time: 2 ms of
every ``Propose`` and every ``Verify``, about 1% of a 0.2 s CPU round and far
more of a GPU one.

:class:`WindowGate` remembers whether each of the last ``memory`` batches had
company (more than one call in it, whether they joined during a wait or had
queued while the thread was busy). While none of them did, batches start at once,
except a probe every ``probe_every`` batches that waits as before, so a second
caller turning up is noticed within a few batches and the window is back on.
"""

from __future__ import annotations

import collections


class WindowGate:
    """Decides per batch whether to wait; told after each batch whether it had company."""

    def __init__(self, *, memory: int = 32, probe_every: int = 16) -> None:
        if memory < 1 or probe_every < 1:
            raise ValueError(f"memory and probe_every must be >= 1, got {memory}, {probe_every}")
        self.probe_every = probe_every
        self._company: collections.deque[bool] = collections.deque(maxlen=memory)
        self._skipped = 0  # batches started at once since the last wait

    @property
    def open(self) -> bool:
        """True while waiting may pay: too few batches seen yet, or one of them had company."""
        return len(self._company) < (self._company.maxlen or 0) or any(self._company)

    def should_wait(self) -> bool:
        """Whether the batch about to start should wait its window (counts skips)."""
        if self.open or self._skipped + 1 >= self.probe_every:
            self._skipped = 0
            return True
        self._skipped += 1
        return False

    def saw(self, company: bool) -> None:
        """A batch is about to run; ``company``: more than one call is in it."""
        self._company.append(company)
