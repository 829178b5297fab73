"""Noticing a hung replica in seconds, never a slow one.

While a call to a replica is outstanding, :func:`call_watched` asks the replica
for its model thread's progress (``GetLoad``: ``progress_steps``, the counter of
:mod:`specserve.serving.progress`, and ``model_cpu_ns``, the thread's CPU time)
every fifth of ``stall_s``. The verdict *stalled* needs a fact, not a timer:

* the counter stood still **and** the model thread consumed no CPU time for
  ``stall_s`` (blocked, deadlocked, or its process stopped) — a thread that gets
  any CPU time on a busy host is slow, not hung; or
* the replica did not answer ``GetLoad`` at all for ``stall_s`` (each poll may
  take the whole stall time: a starved event loop answers late, a stopped
  process or a partition never does).

And it must have somewhere to go: ``may_fail_over()`` says whether another
replica could take the call. With none (a lone target), a stall only turns a
slow answer into an error, so the watch logs what it saw once and keeps
waiting, up to the call's own timeout (the client's deadline). A replica that
answers ``GetLoad`` with an error (it cannot report progress) is taken to be
alive; one that reports no CPU time (``model_cpu_ns`` 0: an older server) is
judged by its counter alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
import grpc.aio

from specserve.orchestrator.fleet.replicas import Replica
from specserve.v1 import common_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")

# --target-stall-s: a target whose model thread stood still this long while it held a
# round is failed over. 0 turns the watch off (only the target timeout then applies).
DEFAULT_STALL_S = 5.0
# CPU time below this over a stall window counts as none (a blocked thread's wake-ups).
IDLE_CPU_NS = 1_000_000
_NO_ANSWER = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class Progress:
    """One ``GetLoad`` answer about the model thread."""

    steps: int
    cpu_ns: int  # 0 = not reported


class Stalled(Exception):
    """The replica's model thread made no progress for the stall time; the call was cancelled."""


async def call_watched(
    replica: Replica,
    call: Awaitable[T],
    stall_s: float,
    *,
    may_fail_over: Callable[[], bool] = lambda: True,
    on_progress: Callable[[], None] | None = None,
) -> T:
    """``await call``, cancelling it and raising :class:`Stalled` if ``replica`` hangs.

    ``stall_s <= 0``: no watch (just ``await call``). ``call`` is awaited in the
    caller's own task, so a call that sends at once (a data-plane connection's) has sent
    before the caller first yields, with no task or loop pass in between. The watch
    starts at the first poll, a fifth of ``stall_s`` in: a call answered before then
    (every round's Verify at accelerator speed) costs a timer, nothing more. On a
    stall (the module docstring says what counts) the watch cancels the caller's task,
    if ``may_fail_over()``, and the cancellation comes out as :class:`Stalled` (a
    cancellation of the caller's own stays one). ``on_progress`` is called whenever a
    poll shows the model thread moved (steps or CPU time).
    """
    if stall_s <= 0:
        return await call
    caller = asyncio.current_task()
    assert caller is not None, "call_watched runs inside a task"
    why: list[str] = []
    waiting = True  # the caller is still inside ``await call``
    loop = asyncio.get_running_loop()
    poll_s = max(0.05, stall_s / 5)
    since = time.monotonic()
    watcher: asyncio.Task[None] | None = None

    def stall(reason: str) -> bool:
        """Cancel the call as stalled; False (and nothing done) with nowhere to go."""
        if not may_fail_over():
            return False
        if waiting and not why:
            why.append(reason)
            caller.cancel()
        return True

    def watch() -> None:
        nonlocal watcher
        if waiting:
            watcher = loop.create_task(
                _watch(
                    replica,
                    lambda: not waiting,
                    stall,
                    on_progress or (lambda: None),
                    stall_s,
                    poll_s,
                    since,
                )
            )

    first_poll = loop.call_later(poll_s, watch)
    try:
        return await call
    except asyncio.CancelledError:
        if why and caller.uncancel() == 0:  # the watch's cancel, and no one else's
            raise Stalled(why[0]) from None
        raise
    finally:
        waiting = False
        first_poll.cancel()
        if watcher is not None:
            watcher.cancel()


async def _watch(
    replica: Replica,
    answered: Callable[[], bool],
    stall: Callable[[str], bool],
    progressed: Callable[[], None],
    stall_s: float,
    poll_s: float,
    since: float,
) -> None:
    """Poll the replica's progress every ``poll_s`` from now on until the call is
    ``answered``; ``stall(why)`` once it stood still ``stall_s`` (again every ``stall_s``
    while ``stall`` declines: no other replica). ``since``: when the call began (the
    thread is taken to have last moved then)."""
    last: Progress | None = None  # at the last sign of progress
    told = False  # a declined verdict was logged
    while not answered():
        seen = await progress_of(replica, stall_s)
        now = time.monotonic()
        if seen is not None and last is None:  # the first answer: what later ones move from
            last, since = seen, now
        elif seen is not None and moved(last, seen):
            last, since = seen, now
            progressed()
        elif now - since >= stall_s and not answered():
            what = "did not answer" if seen is None else f"stayed at step {seen.steps}"
            if seen is not None and seen.cpu_ns:
                what += " and used no CPU time"
            reason = (
                f"{replica.endpoint} made no progress for {now - since:.1f} s "
                f"(--target-stall-s {stall_s:g}): its model thread {what}"
            )
            if stall(reason):
                return
            if not told:
                log.warning("%s; no other replica to fail over to: still waiting", reason)
                told = True
        await asyncio.sleep(poll_s)


def moved(last: Progress, now: Progress) -> bool:
    """Whether the model thread moved since ``last``: another step, or CPU time used."""
    if now.steps != last.steps:
        return True
    return bool(now.cpu_ns) and now.cpu_ns - last.cpu_ns >= IDLE_CPU_NS


async def progress_of(replica: Replica, timeout_s: float) -> Progress | None:
    """The replica's progress; None if it did not answer in time. A replica that
    answers with an error (it cannot report progress) gets a fresh value: alive."""
    try:
        report = await replica.stub.GetLoad(common_pb2.GetLoadRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        if e.code() in _NO_ANSWER:
            return None
        return Progress(time.monotonic_ns(), 0)
    return Progress(int(report.progress_steps), int(report.model_cpu_ns))
