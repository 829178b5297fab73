"""The model executor on its own: coalescing, per-call errors, device failure, loading, closing."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from specserve.engine.errors import InvalidArgument
from specserve.serving.errors import Unavailable
from specserve.serving.executor import ModelExecutor, State
from tests.services.conftest import run


class Backend:
    """Records every batched call; fails on request."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.gate = threading.Event()
        self.gate.set()

    def echo(self, payloads: list[Any]) -> list[Any]:
        assert self.gate.wait(10)
        self.batches.append(payloads)
        if any(p == "bad" for p in payloads):
            raise InvalidArgument("a bad payload")
        if any(p == "crash" for p in payloads):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return [f"done:{p}" for p in payloads]


async def started(window_s: float = 0.0) -> tuple[ModelExecutor[Backend], Backend, list[State]]:
    backend = Backend()
    states: list[State] = []
    ex: ModelExecutor[Backend] = ModelExecutor("test", window_s=window_s, max_batch_sessions=8)
    ex.start(lambda: backend, states.append)
    await asyncio.to_thread(ex.ready.wait, 10)
    return ex, backend, states


def test_calls_within_the_window_share_one_batch() -> None:
    async def go() -> None:
        ex, backend, _ = await started(window_s=0.2)
        done = await asyncio.gather(
            *[ex.submit(Backend.echo, f"p{i}", key="v", sessions=[f"s{i}"]) for i in range(3)]
        )
        assert [d.value for d in done] == ["done:p0", "done:p1", "done:p2"]
        assert backend.batches == [["p0", "p1", "p2"]]
        assert {d.batch_sessions for d in done} == {3}
        await ex.close()

    run(go())


def test_calls_queued_behind_a_busy_model_join_the_next_batch() -> None:
    async def go() -> None:
        ex, backend, _ = await started(window_s=0.0)
        backend.gate.clear()
        first = asyncio.ensure_future(ex.submit(Backend.echo, "a", key="v", sessions=["a"]))
        await asyncio.sleep(0.05)  # "a" is running and holds the model
        rest = [
            asyncio.ensure_future(ex.submit(Backend.echo, p, key="v", sessions=[p]))
            for p in ("b", "c")
        ]
        await asyncio.sleep(0.05)
        assert ex.queue_depth() == 2
        backend.gate.set()
        await asyncio.gather(first, *rest)
        assert backend.batches == [["a"], ["b", "c"]]
        await ex.close()

    run(go())


def test_calls_naming_the_same_session_do_not_share_a_batch() -> None:
    async def go() -> None:
        ex, backend, _ = await started(window_s=0.2)
        await asyncio.gather(
            ex.submit(Backend.echo, "x1", key="v", sessions=["x"]),
            ex.submit(Backend.echo, "x2", key="v", sessions=["x"]),
            ex.submit(Backend.echo, "y", key="v", sessions=["y"]),
        )
        assert backend.batches[0] == ["x1", "y"] and backend.batches[1] == ["x2"]
        await ex.close()

    run(go())


def test_a_typed_error_fails_only_its_own_call() -> None:
    async def go() -> None:
        ex, _, _ = await started(window_s=0.2)
        ok, bad = await asyncio.gather(
            ex.submit(Backend.echo, "fine", key="v", sessions=["f"]),
            ex.submit(Backend.echo, "bad", key="v", sessions=["b"]),
            return_exceptions=True,
        )
        assert ok.value == "done:fine" and ok.batch_sessions == 1  # re-run alone
        assert isinstance(bad, InvalidArgument)
        assert ex.state is State.READY
        await ex.close()

    run(go())


def test_an_untyped_error_is_a_device_failure() -> None:
    async def go() -> None:
        ex, _, states = await started()
        with pytest.raises(RuntimeError, match="illegal memory access"):
            await ex.submit(Backend.echo, "crash", key="v", sessions=["c"])
        assert ex.state is State.FAILED
        with pytest.raises(Unavailable, match="NOT_SERVING until restarted"):
            await ex.submit(Backend.echo, "next", key="v", sessions=["n"])
        await asyncio.sleep(0.01)
        assert states == [State.READY, State.FAILED]
        await ex.close()

    run(go())


def test_calls_are_refused_while_loading_and_after_close() -> None:
    async def go() -> None:
        gate = threading.Event()
        ex: ModelExecutor[Backend] = ModelExecutor("test")
        ex.start(lambda: (gate.wait(10), Backend())[1])
        with pytest.raises(Unavailable, match="still loading"):
            await ex.submit(Backend.echo, "early")
        gate.set()
        await asyncio.to_thread(ex.ready.wait, 10)
        assert (await ex.submit(Backend.echo, "now")).value == "done:now"
        await ex.close()
        with pytest.raises(Unavailable, match="shutting down"):
            await ex.submit(Backend.echo, "late")

    run(go())


def test_a_failed_load_is_reported() -> None:
    async def go() -> None:
        states: list[State] = []
        ex: ModelExecutor[Backend] = ModelExecutor("test")

        def load() -> Backend:
            raise OSError("no such checkpoint")

        ex.start(load, states.append)
        await asyncio.to_thread(ex.ready.wait, 10)
        await asyncio.sleep(0.01)
        assert ex.state is State.FAILED and isinstance(ex.error, OSError)
        assert states == [State.FAILED]
        await ex.close()

    run(go())


def test_a_call_never_overtakes_an_earlier_call_for_the_same_session() -> None:
    async def go() -> None:
        ex, backend, _ = await started(window_s=0.0)
        backend.gate.clear()
        busy = asyncio.ensure_future(ex.submit(Backend.echo, "busy", key="v", sessions=["z"]))
        await asyncio.sleep(0.05)
        jobs = [
            asyncio.ensure_future(ex.submit(Backend.echo, "v-a", key="v", sessions=["a"])),
            asyncio.ensure_future(ex.submit(Backend.echo, "release-b", sessions=["b"])),
            asyncio.ensure_future(ex.submit(Backend.echo, "v-b", key="v", sessions=["b"])),
            asyncio.ensure_future(ex.submit(Backend.echo, "v-c", key="v", sessions=["c"])),
        ]
        await asyncio.sleep(0.05)
        backend.gate.set()
        await asyncio.gather(busy, *jobs)
        assert backend.batches == [["busy"], ["v-a", "v-c"], ["release-b"], ["v-b"]]
        await ex.close()

    run(go())


def test_close_runs_the_backends_close_on_the_model_thread_after_the_queue() -> None:
    async def go() -> None:
        ex, backend, _ = await started()
        closed_on: list[str] = []
        backend.close = lambda: closed_on.append(threading.current_thread().name)  # type: ignore[attr-defined]
        backend.gate.clear()  # hold the model thread so that a job is queued at close
        first = asyncio.ensure_future(ex.submit(Backend.echo, "a", sessions=["a"]))
        await asyncio.sleep(0.05)
        closing = asyncio.ensure_future(ex.close())
        await asyncio.sleep(0.05)
        assert not closed_on  # the job in flight finishes first
        backend.gate.set()
        await closing
        assert (await first).value == "done:a"
        assert closed_on == ["test-model"]

    run(go())
