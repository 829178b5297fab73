"""The model executor: one dedicated thread owns the model, its caches and every call on them.

Model work never runs on the event loop. Servicers ``await`` :meth:`ModelExecutor.submit`,
which queues a job; the model thread takes jobs in arrival order. Jobs that share a
coalescing ``key`` (all ``Verify`` and ``Prefill`` calls; all ``Propose`` calls) and
arrive within ``window_s`` of the first one run as ONE batched call — one forward —
as long as they name disjoint sessions and stay under ``max_batch_sessions``. Jobs
that queued up while the thread was busy join the next batch at once; the window
only delays a batch whose first job has waited less than ``window_s``, and only
while waiting has brought company (:mod:`specserve.serving.batch_window`: one
caller alone does not wait, bar a probe now and then).

Idle work: a backend with an ``idle_step()`` method (returning whether it did work; it
is called again until it returns False) gets it called whenever no job is queued, one
step at a time, the queue checked between steps, so a call that arrives during idle
work waits for at most one step. Idle work starts again after each batch (a batch may
give the backend new work) and never runs while jobs wait, nor once closing began. A
draft replica drafts ahead this way (:mod:`specserve.engine.draft_ahead`).

On :meth:`ModelExecutor.close` the queued jobs finish, then the backend's
``close()`` (if it has one) runs on the model thread: a tensor-parallel target
stops its rank group there.

Failure handling:

* a typed :class:`~specserve.engine.errors.EngineError` from a coalesced batch is
  not the other callers' fault: each job of the batch is re-run alone so that only
  the offending call sees the error (caches are safe to re-run on: every job states
  where its news starts);
* any other exception is a device failure (or a bug): the batch's calls fail, the
  executor turns :attr:`State.FAILED`, later calls are refused with
  :class:`~specserve.serving.errors.Unavailable`, and the state listener (the
  server's health service) reports NOT_SERVING.

Telemetry: a job submitted with a ``kind`` (``propose``, ``verify``) is counted
in :attr:`ModelExecutor.stats` (batch size, queue wait, compute time), and when
its caller was in a trace the batch runs in a span on the model thread
(``specserve.<name>.<kind>``): the caller's OpenTelemetry context is captured at
:meth:`ModelExecutor.submit` and re-attached there. A coalesced batch serves
several callers, so its span is the child of the first traced caller's span and
links to the others'.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Generic, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace

from specserve.engine.errors import EngineError
from specserve.serving.batch_stats import BatchStats
from specserve.serving.batch_window import WindowGate
from specserve.serving.errors import Unavailable
from specserve.serving.executor_job import Done, Job
from specserve.serving.progress import ModelProgress
from specserve.telemetry import attributes as attr

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

B = TypeVar("B")  # the loaded backend (model + caches)
P = TypeVar("P")  # one job's payload
R = TypeVar("R")  # one job's result

# A batched operation: the backend and the payloads of the coalesced jobs -> one result each.
BatchOp = Callable[[B, list[P]], list[R]]


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"  # the model load or a model call failed
    CLOSED = "closed"


class ModelExecutor(Generic[B]):
    """Loads a backend on its own thread, then runs batched jobs on it, one batch at a time."""

    def __init__(
        self,
        name: str,
        *,
        window_s: float = 0.002,
        max_batch_sessions: int = 256,
        gate: Callable[[], WindowGate] = WindowGate,
    ) -> None:
        self.name = name
        self.window_s = window_s
        self._new_gate = gate
        self.max_batch_sessions = max_batch_sessions
        self._on_state: Callable[[State], None] | None = None
        self._cv = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._state = State.LOADING
        self._closing = False
        self._error: BaseException | None = None
        self._backend: B | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()  # set once loading ended, either way
        self.stats = BatchStats()
        self.progress = ModelProgress()  # reported by GetLoad: a hung thread stops it
        self._running = False  # the model thread is inside a batch
        self._gates: dict[str, WindowGate] = {}  # per coalescing key (model thread only)
        self._idle_step: Callable[[], bool] | None = None  # the backend's, if it has one
        self._idle_pending = False  # the backend may have idle work (model thread sets it)
        self.idle_steps = 0  # idle steps that did work

    # -- life cycle (event loop side) -------------------------------------------------

    def start(self, load: Callable[[], B], on_state: Callable[[State], None] | None = None) -> None:
        """Start the model thread: it runs ``load()`` and then serves the queue.

        ``on_state`` hears every state change, on the event loop that called ``start``.
        """
        assert self._thread is None, "started twice"
        self._on_state = on_state
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(
            target=self._main, args=(load,), name=f"{self.name}-model", daemon=True
        )
        self._thread.start()

    async def close(self) -> None:
        """Let the queued jobs finish, then stop the thread (waits without blocking the loop)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._set_state(State.CLOSED)

    @property
    def state(self) -> State:
        return self._state

    @property
    def error(self) -> BaseException | None:
        """Why loading or the model failed, if it did."""
        return self._error

    @property
    def backend(self) -> B:
        """The loaded backend; raises :class:`Unavailable` unless the executor is ready.

        Servicers read only immutable facts from it (vocabulary, snapshots); every
        call that touches the model or its caches goes through :meth:`submit`.
        """
        self._check_open()
        assert self._backend is not None
        return self._backend

    @property
    def loaded_backend(self) -> B | None:
        """The backend once loaded, whatever the state (for metrics; no model calls)."""
        return self._backend

    def queue_depth(self) -> int:
        """Jobs waiting for the model thread (not counting the batch it is running)."""
        return len(self._queue)

    def busy(self) -> bool:
        """Whether the model thread runs a batch or has jobs waiting."""
        return self._running or bool(self._queue)

    # -- submitting (event loop side) -----------------------------------------------

    async def submit(
        self,
        op: BatchOp[B, P, R],
        payload: P,
        *,
        key: str | None = None,
        sessions: Collection[str] = (),
        kind: str | None = None,
    ) -> Done[R]:
        """Run ``op`` on the model thread; jobs with the same ``key`` may share one call.

        ``kind`` names the work for metrics and the batch's span (see the module doc).
        """
        loop = asyncio.get_running_loop()
        ctx = None
        if kind is not None and trace.get_current_span().get_span_context().is_valid:
            ctx = otel_context.get_current()
        job = Job(op, payload, key, frozenset(sessions), loop.create_future(), loop, kind, ctx)
        with self._cv:
            self._check_open()
            self._queue.append(job)
            self._cv.notify()
        return await job.future

    def _check_open(self) -> None:
        if self._closing or self._state is State.CLOSED:
            raise Unavailable(f"the {self.name} replica is shutting down; retry on another")
        if self._state is State.LOADING:
            raise Unavailable(f"the {self.name} replica is still loading its model; retry shortly")
        if self._state is State.FAILED:
            raise Unavailable(
                f"the {self.name} replica's model executor failed ({_describe(self._error)}); "
                "it is NOT_SERVING until restarted"
            )

    # -- the model thread -------------------------------------------------------------

    def _main(self, load: Callable[[], B]) -> None:
        self.progress.attach_thread()  # GetLoad reports this thread's CPU time
        try:
            self._backend = load()
            watched = getattr(self._backend, "progress_modules", None)
            if callable(watched):  # count its layers' forwards (GetLoad's progress_steps)
                self.progress.watch(watched())
        except BaseException as e:
            if isinstance(e, EngineError):  # a bad spec or checkpoint: the message says it all
                log.error("loading the %s model failed: %s", self.name, e)
            else:
                log.exception("loading the %s model failed", self.name)
            self._error = e
            self._set_state(State.FAILED)
            self.ready.set()
            return
        idle_step = getattr(self._backend, "idle_step", None)
        self._idle_step = idle_step if callable(idle_step) else None
        self._set_state(State.READY)
        self.ready.set()
        while (batch := self._next_batch()) is not None:
            if not batch:
                self._run_idle_step()
                continue
            self._running = True
            try:
                self._execute(batch)
            finally:
                self._running = False
                self.progress.step()
            self._idle_pending = self._idle_step is not None and self._state is State.READY
        self._close_backend()

    def _run_idle_step(self) -> None:
        """One step of the backend's idle work. A typed engine error ends idle work until
        the next batch; any other exception is a device failure, as in a batch."""
        assert self._idle_step is not None
        try:
            self._idle_pending = bool(self._idle_step())
        except EngineError as e:
            log.warning("the %s backend's idle work stopped: %s", self.name, e)
            self._idle_pending = False
            return
        except BaseException as e:
            log.exception("the %s model failed in idle work; turning NOT_SERVING", self.name)
            self._idle_pending = False
            self._error = e
            self._set_state(State.FAILED)
            return
        if self._idle_pending:
            self.idle_steps += 1

    def _close_backend(self) -> None:
        """After the last batch: the backend's ``close()``, if it has one, on this thread."""
        close = getattr(self._backend, "close", None)
        if not callable(close):
            return
        try:
            close()
        except Exception:  # shutting down anyway: say so, do not hang or mask the exit
            log.exception("closing the %s backend failed", self.name)

    def _next_batch(self) -> list[Job] | None:
        """The next batch; ``[]`` when the queue is empty and the backend has idle work
        (one step of it runs, then the queue is looked at again); None once closing."""
        with self._cv:
            while not self._queue and not self._closing:
                if self._idle_pending:
                    return []
                self._cv.wait()
            if not self._queue:
                return None
            first = self._queue.popleft()
            batch = [first]
            if first.key is None:
                return batch
            sessions = set(first.sessions)
            self._take_matching(batch, sessions)  # queued while the thread was busy
            deadline = first.enqueued + self.window_s
            gate = self._gates.get(first.key)
            if gate is None:
                gate = self._gates[first.key] = self._new_gate()
            if self._wants_company(sessions, deadline) and gate.should_wait():
                before = len(batch)
                while self._wants_company(sessions, deadline):
                    self._cv.wait(max(0.0, deadline - time.monotonic()))
                    self._take_matching(batch, sessions)
                gate.waited(len(batch) > before)
            return batch

    def _wants_company(self, sessions: set[str], deadline: float) -> bool:
        """Whether the batch may still wait for calls to join it (caller holds the lock)."""
        full = len(sessions) >= self.max_batch_sessions
        return not full and not self._closing and time.monotonic() < deadline

    def _take_matching(self, batch: list[Job], sessions: set[str]) -> None:
        """Move queued jobs that can join ``batch`` into it (caller holds the lock).

        A job never overtakes an earlier queued job that names one of its sessions,
        so calls about one session run in the order they arrived.
        """
        key = batch[0].key
        kept: collections.deque[Job] = collections.deque()
        passed: set[str] = set()  # sessions of the jobs left in the queue so far
        for job in self._queue:
            fits = len(sessions) + len(job.sessions) <= self.max_batch_sessions
            free = sessions.isdisjoint(job.sessions) and passed.isdisjoint(job.sessions)
            if job.key == key and fits and free:
                batch.append(job)
                sessions |= job.sessions
            else:
                kept.append(job)
                passed |= job.sessions
        self._queue = kept

    def _execute(self, batch: list[Job]) -> None:
        if self._state is State.FAILED:
            for job in batch:
                job.resolve(Unavailable(f"the {self.name} replica's model executor failed"))
            return
        started = time.monotonic()
        t0 = time.perf_counter_ns()
        try:
            with self._batch_span(batch):
                results = batch[0].op(self._backend, [job.payload for job in batch])
        except EngineError as e:
            if len(batch) > 1:  # find whose request it was: re-run each job alone
                for job in batch:
                    self._execute([job])
            else:
                batch[0].resolve(e)
            return
        except BaseException as e:
            log.exception("the %s model executor failed; turning NOT_SERVING", self.name)
            self._error = e
            self._set_state(State.FAILED)
            for job in batch:
                job.resolve(e)
            return
        compute_ns = time.perf_counter_ns() - t0
        assert len(results) == len(batch), "a batched op must answer every job"
        sessions = sum(len(job.sessions) for job in batch)
        waits = [max(0.0, started - job.enqueued) for job in batch]
        if batch[0].kind is not None:
            self.stats.observe(batch[0].kind, sessions, waits, compute_ns / 1e9)
        for job, value, wait in zip(batch, results, waits, strict=True):
            job.resolve(Done(value, compute_ns, sessions, len(batch), wait))

    def _batch_span(self, batch: list[Job]) -> contextlib.AbstractContextManager[object]:
        """The batch's span, under the first traced caller, linking the others (if any)."""
        traced = [job.context for job in batch if job.context is not None]
        kind = batch[0].kind
        if not traced or kind is None:
            return contextlib.nullcontext()
        links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in traced[1:]]
        return tracer.start_as_current_span(
            attr.forward_span(self.name, kind),
            context=traced[0],
            links=links,
            attributes={
                attr.OP: kind,
                attr.BATCH_SIZE: sum(len(job.sessions) for job in batch),
                attr.BATCH_CALLS: len(batch),
            },
        )

    def _set_state(self, state: State) -> None:
        if self._state is state:
            return
        self._state = state
        if self._on_state is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_state, state)


def _describe(error: BaseException | None) -> str:
    return f"{type(error).__name__}: {error}" if error is not None else "unknown error"
