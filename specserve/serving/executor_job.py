"""A model executor's job (one submitted call) and its result (:class:`Done`).

A job is made on an event loop by :meth:`ModelExecutor.submit
<specserve.serving.executor.ModelExecutor.submit>` and resolved from the model
thread: :meth:`Job.resolve` hands the result to the caller's loop. A job made on
the model thread itself (:meth:`ModelExecutor.enqueue
<specserve.serving.executor.ModelExecutor.enqueue>`, the data-plane socket's
calls) has an ``on_done`` callback instead, called right there: no thread hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace

from specserve.telemetry import attributes as attr

tracer = trace.get_tracer("specserve.serving.executor")

R = TypeVar("R")  # one job's result


@dataclass(frozen=True)
class Done(Generic[R]):
    """A job's result and the batch it ran in."""

    value: R
    compute_ns: int  # wall time of the batched call on the model thread
    batch_sessions: int  # sessions of every job in that batch
    batch_jobs: int
    queue_s: float = 0.0  # this job's wait from submit to the start of its batch


@dataclass(frozen=True)
class Submission(Generic[R]):
    """A call made ready for the model thread (validated and converted, on whichever
    thread read it): the batched op, this call's payload, what it coalesces under,
    and ``finish``, which turns its :class:`Done` into the answer (or raises the
    call's error). :meth:`ModelExecutor.run
    <specserve.serving.executor.ModelExecutor.run>` runs one from a server's loop; the
    data-plane socket queues it on the model thread."""

    op: Callable[[Any, list[Any]], list[Any]]
    payload: Any
    key: str | None
    sessions: frozenset[str]
    kind: str | None
    finish: Callable[[Done[Any]], R]


@dataclass
class Job:
    """One submitted call: what to run, with which payload, and whom to tell."""

    op: Callable[[Any, list[Any]], list[Any]]
    payload: Any
    key: str | None
    sessions: frozenset[str]
    future: asyncio.Future[Done[Any]] | None  # None: on_done hears the result
    loop: asyncio.AbstractEventLoop | None
    kind: str | None = None  # counted and traced under this name; None = neither
    context: otel_context.Context | None = None  # the caller's, when it was in a trace
    enqueued: float = field(default_factory=time.monotonic)
    # called with the result on the model thread; it must not raise
    on_done: Callable[[Done[Any] | BaseException], None] | None = None

    def resolve(self, value: Done[Any] | BaseException) -> None:
        if self.on_done is not None:
            self.on_done(value)
            return
        future, loop = self.future, self.loop
        assert future is not None and loop is not None

        def _set() -> None:
            if future.done():  # the caller went away
                return
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

        loop.call_soon_threadsafe(_set)


def batch_span(name: str, batch: list[Job]) -> contextlib.AbstractContextManager[object]:
    """The span a batch runs in (``specserve.<name>.<kind>``): under the first traced
    caller's context, linking the others'; none when no caller was traced."""
    traced = [job.context for job in batch if job.context is not None]
    kind = batch[0].kind
    if not traced or kind is None:
        return contextlib.nullcontext()
    links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in traced[1:]]
    return tracer.start_as_current_span(
        attr.forward_span(name, kind),
        context=traced[0],
        links=links,
        attributes={
            attr.OP: kind,
            attr.BATCH_SIZE: sum(len(job.sessions) for job in batch),
            attr.BATCH_CALLS: len(batch),
        },
    )
