"""The model executor's queue: which submitted jobs run together as one batch.

Jobs that share a coalescing ``key`` (all ``Verify`` and ``Prefill`` calls; all
``Propose`` calls) run as one batched call, one forward, as long as they name
disjoint sessions and stay under ``max_batch_sessions``. A job never overtakes an
earlier queued job that names one of its sessions, so calls about one session run
in the order they arrived. Jobs that queued up while the model was busy join the
next batch at once; the window (``window_s`` from the first job's arrival) only
holds a batch open while waiting has brought company
(:mod:`specserve.serving.batch_window`).

Not thread-safe on its own: the executor calls it under its lock.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from specserve.serving.batch_window import WindowGate
from specserve.serving.executor_job import Job


@dataclass
class _Forming:
    """A batch held open for its window: its jobs so far and what they name."""

    jobs: list[Job]
    sessions: set[str]
    deadline: float  # time.monotonic() at which it runs, company or not
    gate: WindowGate
    joined_at_start: int  # jobs it had when the wait began


class JobQueue:
    """Submitted jobs in arrival order, taken a batch at a time (see the module doc)."""

    def __init__(
        self,
        window_s: float,
        max_batch_sessions: int,
        gate: Callable[[], WindowGate] = WindowGate,
    ) -> None:
        self.window_s = window_s
        self.max_batch_sessions = max_batch_sessions
        self._new_gate = gate
        self._jobs: collections.deque[Job] = collections.deque()
        self._forming: _Forming | None = None
        self._gates: dict[str, WindowGate] = {}  # per coalescing key
        self.closing = False  # set once: no batch waits for company any more

    def push(self, job: Job) -> None:
        self._jobs.append(job)

    def __len__(self) -> int:
        """Jobs waiting (a batch held open for its window counts as waiting)."""
        held = len(self._forming.jobs) if self._forming is not None else 0
        return len(self._jobs) + held

    def take(self) -> list[Job] | float | None:
        """The next batch to run; or, while a batch is held open for company, the
        ``time.monotonic()`` at which its window ends (take again then, or when a job
        arrives); None when nothing waits."""
        forming = self._forming
        if forming is not None:
            self._take_matching(forming.jobs, forming.sessions)
            if self._wants_company(forming.sessions, forming.deadline):
                return forming.deadline
            forming.gate.waited(len(forming.jobs) > forming.joined_at_start)
            self._forming = None
            return forming.jobs
        if not self._jobs:
            return None
        first = self._jobs.popleft()
        batch = [first]
        if first.key is None:
            return batch
        sessions = set(first.sessions)
        self._take_matching(batch, sessions)  # queued while the model was busy
        deadline = first.enqueued + self.window_s
        gate = self._gates.get(first.key)
        if gate is None:
            gate = self._gates[first.key] = self._new_gate()
        if self._wants_company(sessions, deadline) and gate.should_wait():
            self._forming = _Forming(batch, sessions, deadline, gate, len(batch))
            return deadline
        return batch

    def _wants_company(self, sessions: set[str], deadline: float) -> bool:
        """Whether a batch may still wait for calls to join it."""
        full = len(sessions) >= self.max_batch_sessions
        return not full and not self.closing and time.monotonic() < deadline

    def _take_matching(self, batch: list[Job], sessions: set[str]) -> None:
        """Move queued jobs that can join ``batch`` into it, in order, never past an
        earlier queued job about one of their sessions."""
        key = batch[0].key
        kept: collections.deque[Job] = collections.deque()
        passed: set[str] = set()  # sessions of the jobs left in the queue so far
        for job in self._jobs:
            fits = len(sessions) + len(job.sessions) <= self.max_batch_sessions
            free = sessions.isdisjoint(job.sessions) and passed.isdisjoint(job.sessions)
            if job.key == key and fits and free:
                batch.append(job)
                sessions |= job.sessions
            else:
                kept.append(job)
                passed |= job.sessions
        self._jobs = kept
