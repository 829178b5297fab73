"""The model executor's idle work: it runs only while no call waits, a step at a time."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from specserve.engine.errors import InvalidArgument
from specserve.serving.executor import ModelExecutor, State
from tests.services.conftest import run

STEP_S = 0.02  # one idle step (a draft forward, say)


class IdleBackend:
    """Has ``steps`` idle steps of work after each batch; records what ran when."""

    def __init__(self, steps: int, fail: BaseException | None = None) -> None:
        self.steps = steps
        self.fail = fail
        self.left = 0
        self.done = 0  # idle steps run, in all
        self.in_idle = threading.Event()  # set once the second idle step runs
        self.seen_at_batch: list[int] = []  # ``done`` when each batch ran

    def work(self, payloads: list[Any]) -> list[Any]:
        self.seen_at_batch.append(self.done)
        self.left = self.steps  # a batch gives new idle work
        return payloads

    def idle_step(self) -> bool:
        if self.left == 0:
            return False
        if self.fail is not None:
            raise self.fail
        self.left -= 1
        self.done += 1
        if self.done == 2:
            self.in_idle.set()
        time.sleep(STEP_S)
        return True


async def started(backend: IdleBackend) -> ModelExecutor[IdleBackend]:
    ex: ModelExecutor[IdleBackend] = ModelExecutor("test", window_s=0.0)
    ex.start(lambda: backend)
    await asyncio.to_thread(ex.ready.wait, 10)
    return ex


def test_a_call_arriving_during_idle_work_waits_at_most_one_step() -> None:
    async def go() -> None:
        backend = IdleBackend(steps=100)  # 2 s of idle work if it ran to the end
        ex = await started(backend)
        await ex.submit(IdleBackend.work, "first")
        assert await asyncio.to_thread(backend.in_idle.wait, 10)
        done = await ex.submit(IdleBackend.work, "second")
        # The second idle step was running when the call came: it ran next or one after.
        assert backend.seen_at_batch[1] in (2, 3)
        assert done.queue_s < 5 * STEP_S
        await asyncio.sleep(10 * STEP_S)  # idle work goes on after the call
        assert backend.done > backend.seen_at_batch[1]
        await ex.close()

    run(go())


def test_idle_work_stops_when_the_backend_has_none() -> None:
    async def go() -> None:
        backend = IdleBackend(steps=3)
        ex = await started(backend)
        await ex.submit(IdleBackend.work, "a")
        await asyncio.sleep(10 * STEP_S)
        assert backend.done == 3 and ex.idle_steps == 3
        await ex.submit(IdleBackend.work, "b")  # a batch starts it again
        await asyncio.sleep(10 * STEP_S)
        assert backend.done == 6 and ex.idle_steps == 6
        await ex.close()

    run(go())


def test_a_typed_error_in_idle_work_stops_it_and_the_replica_serves_on() -> None:
    async def go() -> None:
        backend = IdleBackend(steps=5, fail=InvalidArgument("nothing to draft ahead"))
        ex = await started(backend)
        await ex.submit(IdleBackend.work, "a")
        await asyncio.sleep(5 * STEP_S)
        assert ex.state is State.READY and ex.idle_steps == 0
        assert (await ex.submit(IdleBackend.work, "b")).value == "b"
        await ex.close()

    run(go())


def test_an_untyped_error_in_idle_work_is_a_device_failure() -> None:
    async def go() -> None:
        backend = IdleBackend(steps=5, fail=RuntimeError("CUDA error: device lost"))
        ex = await started(backend)
        await ex.submit(IdleBackend.work, "a")
        for _ in range(100):
            if ex.state is State.FAILED:
                break
            await asyncio.sleep(STEP_S)
        assert ex.state is State.FAILED and isinstance(ex.error, RuntimeError)
        await ex.close()

    run(go())
