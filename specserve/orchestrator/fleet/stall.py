"""Noticing a hung replica in seconds, not at the end of the target timeout.

While a call to a replica is outstanding, :func:`call_watched` asks the replica
for its model thread's progress counter (``GetLoad``'s ``progress_steps``,
:mod:`specserve.serving.progress`) every fifth of ``stall_s``. If the counter
has not moved — or the replica has not answered at all (a stopped process, a
partition) — for ``stall_s`` seconds while the call is still out, the call is
cancelled and :class:`Stalled` raised: the caller fails the replica over as if
it were lost. A slow call on a replica whose counter keeps moving (a long
prefill steps once per attention layer) is waited for, up to the call's own
timeout. A replica that answers ``GetLoad`` with an error (it cannot report
progress) is taken to be alive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import grpc.aio

from specserve.orchestrator.fleet.replicas import Replica
from specserve.v1 import common_pb2

T = TypeVar("T")

# --target-stall-s: a target whose model thread stood still this long while it held a
# round is failed over. 0 turns the watch off (only the target timeout then applies).
DEFAULT_STALL_S = 5.0
_NO_ANSWER = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})


class Stalled(Exception):
    """The replica's model thread made no progress for the stall time; the call was cancelled."""


async def call_watched(replica: Replica, call: Awaitable[T], stall_s: float) -> T:
    """``await call``, cancelling it and raising :class:`Stalled` if ``replica`` hangs.

    ``stall_s <= 0``: no watch (just ``await call``). ``call`` is awaited in the
    caller's own task, so a call that sends at once (a data-plane stream's) has sent
    before the caller first yields, with no task or loop pass in between. The watch
    starts at the first poll, a fifth of ``stall_s`` in: a call answered before then
    (every round's Verify at accelerator speed) costs a timer, nothing more. On a
    stall the watch cancels the caller's task and the cancellation comes out as
    :class:`Stalled` (a cancellation of the caller's own stays one).
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

    def stall(reason: str) -> None:
        if waiting and not why:
            why.append(reason)
            caller.cancel()

    def watch() -> None:
        nonlocal watcher
        if waiting:
            watcher = loop.create_task(
                _watch(replica, lambda: not waiting, stall, stall_s, poll_s, since)
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
    stall: Callable[[str], None],
    stall_s: float,
    poll_s: float,
    since: float,
) -> None:
    """Poll the replica's progress every ``poll_s`` from now on until the call is
    ``answered``; ``stall(why)`` once it stood still ``stall_s``. ``since``: when the
    call began (the counter is taken to have last moved then)."""
    last_steps: int | None = None
    while not answered():
        steps = await progress_steps(replica, poll_s)
        now = time.monotonic()
        if steps is not None and steps != last_steps:
            last_steps, since = steps, now
        elif now - since >= stall_s and not answered():
            seen = "did not answer" if steps is None else f"stayed at step {steps}"
            stall(
                f"{replica.endpoint} made no progress for {now - since:.1f} s "
                f"(--target-stall-s {stall_s:g}): its model thread {seen}"
            )
            return
        await asyncio.sleep(poll_s)


async def progress_steps(replica: Replica, timeout_s: float) -> int | None:
    """The replica's progress counter; None if it did not answer in time. A replica that
    answers with an error (it cannot report progress) gets a fresh value: alive."""
    try:
        report = await replica.stub.GetLoad(common_pb2.GetLoadRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        if e.code() in _NO_ANSWER:
            return None
        return time.monotonic_ns()
    return int(report.progress_steps)
