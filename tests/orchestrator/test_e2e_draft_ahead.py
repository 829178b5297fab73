"""Draft-ahead over real processes: greedy output unchanged, bets placed, and some come true.

The draft is a low-noise copy of the target (it agrees on most tokens), so whole
rounds are often accepted and the draft's guess of the bonus token is often
right. More orchestrators on the same replicas: with one lane per target every
session bets; with ``--draft-ahead off`` none does; the tokens are the same.
Sampled sessions never bet.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest

from specserve.client import AsyncClient, Client
from specserve.orchestrator.launch import OrchestratorProcess
from tests.orchestrator.redis_server import free_port
from tests.orchestrator.stack import ENV, Reference, Stack, kv_used, scrape

pytestmark = pytest.mark.redis

CLOSE_DRAFT = "tiny:3:noise=0.02"
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def ahead_stack(redis_url: str) -> Iterator[Stack]:
    s = Stack(
        redis_url,
        draft_model=CLOSE_DRAFT,
        orchestrator_args=["--draft-ahead", "on", "--pipeline-groups", "2"],
    )
    try:
        yield s.start()
    finally:
        s.stop()


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(8 + seed % 5)]


def counts(port: int) -> dict[str, float]:
    """Bets, hits and misses (all reasons) the orchestrator on ``port`` reports."""
    misses = scrape(port, "specserve_orchestrator_draft_ahead_misses")
    return {
        "bets": scrape(port, "specserve_orchestrator_draft_ahead_bets")[""],
        "hits": scrape(port, "specserve_orchestrator_draft_ahead_hits")[""],
        "misses": sum(misses.values()),
        "rounds": scrape(port, "specserve_orchestrator_rounds")[""],
    }


def stream_all(address: str, cases: list[tuple[list[int], dict[str, object]]]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with AsyncClient(address, timeout_s=120) as c:

            async def one(p: list[int], kw: dict[str, object]) -> list[int]:
                out: list[int] = []
                async for d in c.stream(p, max_new_tokens=NEW_TOKENS, **kw):
                    out.extend(d.token_ids)
                return out

            return await asyncio.gather(*(one(p, kw) for p, kw in cases))

    return asyncio.run(run())


def test_greedy_output_unchanged_with_hits(ahead_stack: Stack, reference: Reference) -> None:
    assert ahead_stack.draft is not None
    draft = ahead_stack.draft.address
    base_draft = kv_used(draft, "draft")
    port = ahead_stack.metrics_port
    before = counts(port)
    with Client(ahead_stack.address, timeout_s=60) as c:  # one session: its lane alone
        one = c.generate(prompt(9), max_new_tokens=NEW_TOKENS, k=4)
    assert one.token_ids == reference.decode(prompt(9), NEW_TOKENS)
    assert one.usage.drafted_tokens > 0 and one.usage.accepted_tokens > 0
    alone = counts(port)
    delta = {name: alone[name] - before[name] for name in alone}
    assert delta["hits"] > 0
    # Every bet settles (a hit or a miss) at its session's next round, or is dropped when
    # the session ends; every hit saved a Propose, so rounds outnumber them.
    assert delta["hits"] + delta["misses"] <= delta["bets"] < delta["rounds"] + 1
    # Concurrent sessions in two lanes (pipeline groups) share the draft replica: the
    # lanes keep it busy, so they bet only once a lane is left alone; tokens stay exact.
    cases: list[tuple[list[int], dict[str, object]]] = [
        (prompt(i), {"k": 4} if i % 2 else {}) for i in range(4)
    ]
    got = stream_all(ahead_stack.address, cases)
    for (p, _), tokens in zip(cases, got, strict=True):
        assert tokens == reference.decode(p, NEW_TOKENS)
    wait_until(lambda: kv_used(draft, "draft") == base_draft)


def test_sampled_sessions_do_not_bet(ahead_stack: Stack) -> None:
    before = counts(ahead_stack.metrics_port)
    with Client(ahead_stack.address, timeout_s=60) as c:
        out = c.generate(prompt(3), max_new_tokens=24, temperature=0.8, seed=7, k=4)
    assert out.usage.accepted_tokens > 0
    after = counts(ahead_stack.metrics_port)
    assert after["rounds"] > before["rounds"] and after["bets"] == before["bets"]


def test_one_lane_bets_for_all_its_sessions_and_off_never_bets(ahead_stack: Stack) -> None:
    """Two more orchestrators on the same replicas: one lane per target (every session
    bets, several per draft call), and draft-ahead off; same tokens, no bet when off."""
    assert ahead_stack.draft is not None
    targets = ",".join(t.address for t in ahead_stack.target_procs)
    common = ["--target", targets, "--draft", ahead_stack.draft.address]
    common += ["--redis-url", ahead_stack.redis_url]
    ports = {"one-lane": free_port(), "off": free_port()}
    flags = {
        "one-lane": ["--pipeline-groups", "1", "--draft-ahead", "on"],
        "off": ["--draft-ahead", "off"],
    }
    cases: list[tuple[list[int], dict[str, object]]] = [(prompt(20 + i), {}) for i in range(3)]
    tokens = {}
    for name, port in ports.items():
        args = [*common, *flags[name], "--metrics-port", str(port)]
        with OrchestratorProcess(args, env=ENV) as orchestrator:
            orchestrator.wait_serving()
            tokens[name] = stream_all(orchestrator.address, cases)
            got = counts(port)
        if name == "off":
            assert got["rounds"] > 0 and got["bets"] == got["hits"] == got["misses"] == 0
        else:
            assert got["bets"] > got["rounds"] and got["hits"] > 0  # sessions bet together
    assert tokens["one-lane"] == tokens["off"] == stream_all(ahead_stack.address, cases)


def wait_until(check, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
