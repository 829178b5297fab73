"""The coalescing window's gate: a lone caller stops waiting, company brings the wait back."""

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


def test_the_gate_waits_until_its_memory_is_full_of_lone_batches() -> None:
    gate = WindowGate(memory=3, probe_every=4)
    for _ in range(3):
        assert gate.should_wait()
        gate.saw(False)
    assert not gate.open
    assert [gate.should_wait() for _ in range(8)] == [False, False, False, True] * 2


def test_one_batch_with_company_opens_the_gate_for_as_long_as_it_is_remembered() -> None:
    gate = WindowGate(memory=2, probe_every=100)
    for company in (False, False, True):
        gate.saw(company)
    assert gate.open and gate.should_wait()
    gate.saw(False)
    assert gate.open  # the company is one batch back
    gate.saw(False)
    assert not gate.open and not gate.should_wait()


def test_the_gate_rejects_an_empty_memory() -> None:
    with pytest.raises(ValueError, match="memory"):
        WindowGate(memory=0)


def test_a_lone_caller_stops_waiting_and_a_second_caller_brings_the_window_back() -> None:
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

        waits = [await lone(i) for i in range(5)]
        # two waits fill the memory with lone batches; then two start at once; the third probes
        assert [w >= WAITED_S for w in waits] == [True, True, False, False, True]
        assert all(w < STARTED_AT_ONCE_S for w in waits[2:4])
        backend.gate.clear()  # a second caller's calls queue behind a busy model
        held = asyncio.ensure_future(lone(5))
        await asyncio.sleep(0.05)
        pair = [
            asyncio.ensure_future(ex.submit(Backend.echo, f"q{i}", key="v", sessions=[f"s{i}"]))
            for i in range(2)
        ]
        await asyncio.sleep(0.05)
        backend.gate.set()
        await held
        assert {d.batch_jobs for d in await asyncio.gather(*pair)} == {2}
        assert await lone(6) >= WAITED_S  # the pair's batch is remembered: waiting again
        other_key = await ex.submit(Backend.echo, "r", key="propose", sessions=["a"])
        assert other_key.queue_s >= WAITED_S  # each kind of call has its own gate
        await ex.close()

    run(go())
