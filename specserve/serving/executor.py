"""The model executor: one dedicated thread owns the model, its caches and every call on them.

Model work never runs on a server's event loop. The model thread runs an event loop
of its own (:attr:`ModelExecutor.model_loop`) whose callbacks are the batches:
servicers ``await`` :meth:`ModelExecutor.submit` from any loop (a hop to the model
thread and back), while whatever is served on the model loop itself (the data-plane
socket, :mod:`specserve.serving.socket_plane`) reads its calls between batches and
queues them with :meth:`ModelExecutor.enqueue`, answered on the model thread: no
thread hop on a round's critical path. Which queued jobs run together as one
batched call, one forward, is :mod:`specserve.serving.job_queue`'s rule (a shared
coalescing key, disjoint sessions, at most ``max_batch_sessions``, a window of
``window_s`` only while waiting brings company); after each batch the loop reads
what arrived meanwhile before the next one forms.

Idle work: a backend with an ``idle_step()`` method (returning whether it did work)
gets it called whenever no job is queued, one step at a time, the queue and sockets
checked between steps (a call arriving meanwhile waits one step at most); it starts
again after each batch and never runs while jobs wait, nor once closing began. A
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

Telemetry: a job with a ``kind`` (``propose``, ``verify``) is counted in
:attr:`ModelExecutor.stats` (batch size, queue wait, compute time), and when its
caller was in a trace (the context captured at :meth:`ModelExecutor.submit`) the
batch runs in a span ``specserve.<name>.<kind>``, child of the first traced
caller's span, linking the others'.
"""

from __future__ import annotations

import asyncio
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
from specserve.serving.executor_job import Done, Job, Submission, batch_span
from specserve.serving.job_queue import JobQueue
from specserve.serving.progress import ModelProgress

log = logging.getLogger(__name__)

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
        self.max_batch_sessions = max_batch_sessions
        self._on_state: Callable[[State], None] | None = None
        self._lock = threading.Lock()  # the queue, the state's checks, the pump flag
        self._queue = JobQueue(window_s, max_batch_sessions, gate)
        self._state = State.LOADING
        self._closing = False
        self._error: BaseException | None = None
        self._backend: B | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that started it
        # The model thread's own loop: it runs the batches, and the I/O of whatever is
        # served on it (the data-plane socket), between batches.
        self.model_loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._pump_pending = False  # a _pump is scheduled on the model loop
        self._window_timer: asyncio.TimerHandle | None = None
        self.ready = threading.Event()  # set once loading ended, either way
        self.stats = BatchStats()
        self.progress = ModelProgress()  # reported by GetLoad: a hung thread stops it
        self._running = False  # the model thread is inside a batch
        self._idle_step: Callable[[], bool] | None = None  # the backend's, if it has one
        self._idle_pending = False  # the backend may have idle work (model thread sets it)
        self.idle_steps = 0  # idle steps that did work

    # -- life cycle (event loop side) -------------------------------------------------

    def start(self, load: Callable[[], B], on_state: Callable[[State], None] | None = None) -> None:
        """Start the model thread: it runs ``load()`` and then its loop, serving the queue.

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
        with self._lock:
            self._closing = True
            self._queue.closing = True
            if self._thread is not None:
                self._kick()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        else:
            self.model_loop.close()
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
        return self._running or bool(len(self._queue))

    # -- submitting ---------------------------------------------------------------------

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
        self.enqueue(job)
        assert job.future is not None
        return await job.future

    async def run(self, call: Submission[R]) -> R:
        """Run a prepared call on the model thread and finish it (from any event loop)."""
        done = await self.submit(
            call.op, call.payload, key=call.key, sessions=call.sessions, kind=call.kind
        )
        return call.finish(done)

    def enqueue(self, job: Job) -> None:
        """Queue ``job`` (raises :class:`Unavailable` unless serving). From the model
        loop, a job with ``on_done`` is answered on the model thread, no hop."""
        with self._lock:
            self._check_open()
            self._queue.push(job)
            self._kick()

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

    def _kick(self) -> None:
        """Have the model loop look at the queue soon (caller holds the lock)."""
        if self._pump_pending:
            return
        self._pump_pending = True
        if self._thread is not None and threading.get_ident() == self._thread.ident:
            self.model_loop.call_soon(self._pump)
        else:
            self.model_loop.call_soon_threadsafe(self._pump)

    # -- the model thread -------------------------------------------------------------

    def _main(self, load: Callable[[], B]) -> None:
        asyncio.set_event_loop(self.model_loop)
        loaded = self._load(load)
        with self._lock:
            self._kick()  # jobs or a close may have come while loading
        try:
            self.model_loop.run_forever()
        finally:
            if loaded:
                self._close_backend()
            self.model_loop.close()

    def _load(self, load: Callable[[], B]) -> bool:
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
            return False
        idle_step = getattr(self._backend, "idle_step", None)
        self._idle_step = idle_step if callable(idle_step) else None
        self._set_state(State.READY)
        self.ready.set()
        return True

    def _pump(self) -> None:
        """On the model loop: run the next batch, or wait for its window, or one idle
        step, or stop the loop once closing found the queue empty. After a batch or an
        idle step it runs again once the loop has read what arrived meanwhile."""
        with self._lock:
            self._pump_pending = False
            taken = self._queue.take()
            stop = self._closing and taken is None
        if isinstance(taken, list):
            self._running = True
            try:
                self._execute(taken)
            finally:
                self._running = False
                self.progress.step()
            self._idle_pending = self._idle_step is not None and self._state is State.READY
            self._again()
        elif isinstance(taken, float):
            self._wake_at(taken)
        elif stop:
            self.model_loop.stop()
        elif self._idle_pending:
            self._run_idle_step()
            if self._idle_pending:
                self._again()

    def _again(self) -> None:
        """Pump again after the loop's next poll for I/O (a zero-delay timer runs after
        the poll's callbacks: calls that arrived during the batch join the next one)."""
        with self._lock:
            if not self._pump_pending:
                self._pump_pending = True
                self.model_loop.call_later(0, self._pump)

    def _wake_at(self, when: float) -> None:
        """Pump when a held batch's window ends (a job's arrival pumps sooner)."""
        if self._window_timer is not None:
            self._window_timer.cancel()
        delay = max(0.0, when - time.monotonic())
        self._window_timer = self.model_loop.call_later(delay, self._again)

    def _run_idle_step(self) -> None:
        """One step of the backend's idle work. A typed engine error ends idle work until
        the next batch; any other exception is a device failure, as in a batch."""
        assert self._idle_step is not None
        if self._closing or self._state is not State.READY:
            self._idle_pending = False
            return
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

    def _execute(self, batch: list[Job]) -> None:
        if self._state is State.FAILED:
            for job in batch:
                job.resolve(Unavailable(f"the {self.name} replica's model executor failed"))
            return
        started = time.monotonic()
        t0 = time.perf_counter_ns()
        try:
            with batch_span(self.name, batch):
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

    def _set_state(self, state: State) -> None:
        if self._state is state:
            return
        self._state = state
        if self._on_state is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_state, state)


def _describe(error: BaseException | None) -> str:
    return f"{type(error).__name__}: {error}" if error is not None else "unknown error"
