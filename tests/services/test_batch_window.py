"""The coalescing window's gate: a lone caller stops waiting, a caller in step brings it back."""

from __future__ import annotations

import asyncio

import pytest

from specserve.serving.batch_window import WindowGate
from specserve.serving.executor import ModelExecutor
from tests.services.conftest import run
from tests.services.test_executor import Backend

WINDOW_S = 0.2
WAITED_S = 0.15  # a call that waited its window queued at least this long
STARTED_AT_ONCE_S = 0.1  # one that did not, far less


def test_a_gate_that_caught_nothing_waits_only_to_probe() -> None:
    gate = WindowGate(memory=3, probe_every=4)
    pattern = []
    for _ in range(9):
        wait = gate.should_wait()
        pattern.append(wait)
        if wait:
            gate.waited(False)
    assert pattern == [True, False, False, False, True, False, False, False, True]
    assert not gate.open


def test_a_wait_that_caught_a_call_opens_the_gate_for_as_long_as_it_is_remembered() -> None:
    gate = WindowGate(memory=2, probe_every=100)
    assert gate.should_wait()  # the first batch probes
    gate.waited(True)
    assert gate.open and gate.should_wait()
    gate.waited(False)
    assert gate.open and gate.should_wait()  # the catch is one wait back
    gate.waited(False)
    assert not gate.open and not gate.should_wait()


def test_the_gate_rejects_an_empty_memory() -> None:
    with pytest.raises(ValueError, match="memory"):
        WindowGate(memory=0)


def test_only_a_caller_in_step_opens_the_window_not_calls_queued_behind_a_busy_model() -> None:
    async def go() -> None:
        backend = Backend()
        ex: ModelExecutor[Backend] = ModelExecutor(
            "test", window_s=WINDOW_S, gate=lambda: WindowGate(memory=2, probe_every=3)
        )
        ex.start(lambda: backend)
        await asyncio.to_thread(ex.ready.wait, 10)

        async def lone(i: int) -> float:
            done = await ex.submit(Backend.echo, f"p{i}", key="v", sessions=["a"])
            assert done.batch_jobs == 1
            return done.queue_s

        waits = [await lone(i) for i in range(3)]
        # the first batch probes and catches nothing; then two start at once
        assert [w >= WAITED_S for w in waits] == [True, False, False]
        assert all(w < STARTED_AT_ONCE_S for w in waits[1:])
        # batch 4 probes; a second caller's calls queue behind it while the model is busy
        backend.gate.clear()
        held = asyncio.ensure_future(lone(3))
        await asyncio.sleep(WINDOW_S + 0.05)  # past the probe's window: the model is busy
        pair = [
            asyncio.ensure_future(ex.submit(Backend.echo, f"q{i}", key="v", sessions=[f"s{i}"]))
            for i in range(2)
        ]
        await asyncio.sleep(0.05)
        backend.gate.set()
        assert await held >= WAITED_S
        assert {d.batch_jobs for d in await asyncio.gather(*pair)} == {2}  # joined, no wait
        assert await lone(4) < STARTED_AT_ONCE_S  # that company did not open the window
        # batch 7 probes, and a second caller in step arrives within its window
        probe = asyncio.ensure_future(ex.submit(Backend.echo, "r0", key="v", sessions=["a"]))
        await asyncio.sleep(0.05)
        joined = await ex.submit(Backend.echo, "r1", key="v", sessions=["b"])
        assert joined.batch_jobs == 2 and (await probe).batch_jobs == 2
        after = await ex.submit(Backend.echo, "after", key="v", sessions=["a"])
        assert after.queue_s >= WAITED_S  # the catch opened the window
        other_key = await ex.submit(Backend.echo, "k", key="propose", sessions=["a"])
        assert other_key.queue_s >= WAITED_S  # each kind of call has its own gate (first probes)
        await ex.close()

    run(go())
