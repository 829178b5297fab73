"""A model executor's job (one submitted call) and its result (:class:`Done`).

A job is made on the event loop by :meth:`ModelExecutor.submit
<specserve.serving.executor.ModelExecutor.submit>` and resolved from the model
thread: :meth:`Job.resolve` hands the result to the caller's loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from opentelemetry import context as otel_context

R = TypeVar("R")  # one job's result


@dataclass(frozen=True)
class Done(Generic[R]):
    """A job's result and the batch it ran in."""

    value: R
    compute_ns: int  # wall time of the batched call on the model thread
    batch_sessions: int  # sessions of every job in that batch
    batch_jobs: int
    queue_s: float = 0.0  # this job's wait from submit to the start of its batch


@dataclass
class Job:
    """One submitted call: what to run, with which payload, and whom to tell."""

    op: Callable[[Any, list[Any]], list[Any]]
    payload: Any
    key: str | None
    sessions: frozenset[str]
    future: asyncio.Future[Done[Any]]
    loop: asyncio.AbstractEventLoop
    kind: str | None = None  # counted and traced under this name; None = neither
    context: otel_context.Context | None = None  # the caller's, when it was in a trace
    enqueued: float = field(default_factory=time.monotonic)

    def resolve(self, value: Done[Any] | BaseException) -> None:
        def _set() -> None:
            if self.future.done():  # the caller went away
                return
            if isinstance(value, BaseException):
                self.future.set_exception(value)
            else:
                self.future.set_result(value)

        self.loop.call_soon_threadsafe(_set)
