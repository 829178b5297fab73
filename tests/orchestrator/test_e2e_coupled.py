"""A seed means the same tokens, through the whole stack (coupled sampling, the default).

Seeded sampled output through client -> orchestrator -> draft + target equals
target-only seeded sampling in this process (:class:`Reference`, drafter none), for
every k, adaptive k, both drafters, in one mixed batch, after a target is killed
mid-stream, and on a kept session's next turn after the orchestrator restarted. Each
test asserts that drafts were proposed and accepted. A requested k is drafted in full
while the load cap is 0.
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Iterator

import pytest

from specserve.client import AsyncClient, Client
from specserve.engine.sampling import SamplingParams
from specserve.orchestrator.launch import OrchestratorProcess
from tests.orchestrator.redis_server import free_port
from tests.orchestrator.stack import Reference, Stack, stored_record

pytestmark = pytest.mark.redis

# The draft is a noisy copy of the target; at these temperatures its proposals match
# the target's often enough to accept (the n-gram drafter needs repetitive text).
SAMPLED = {"model": {"temperature": 0.7, "top_k": 40}, "ngram": {"temperature": 0.3}}


def prompt(seed: int, n: int = 6) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)] * 3


def params(sampled: dict[str, float], seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=sampled["temperature"], top_k=int(sampled.get("top_k", 0)), seed=seed
    )


def test_every_k_and_drafter_in_one_batch_equals_target_only(
    stack: Stack, reference: Reference
) -> None:
    cases = []
    for drafter in ("model", "ngram"):
        for i, k in enumerate([1, 2, 3, 4, 5, 6, 7, 8, None]):
            seed = 500 + 10 * i + (drafter == "ngram")
            p = prompt(seed)
            want = reference.decode(p, 40, params=params(SAMPLED[drafter], seed))
            kw = {"drafter": drafter, "k": k, "seed": seed, **SAMPLED[drafter]}
            cases.append((p, kw, want))

    async def run_all() -> list[tuple[list[int], object]]:
        async with AsyncClient(stack.address, timeout_s=120) as c:

            async def one(p, kw):  # type: ignore[no-untyped-def]
                got = await c.generate(p, max_new_tokens=40, **kw)
                return got.token_ids, got.usage

            return await asyncio.gather(*(one(p, kw) for p, kw, _ in cases))

    results = asyncio.run(run_all())
    for (_, kw, want), (tokens, _) in zip(cases, results, strict=True):
        assert tokens == want, kw
    for drafter in ("model", "ngram"):
        usage = [
            u for (_, kw, _), (_, u) in zip(cases, results, strict=True) if kw["drafter"] == drafter
        ]
        assert sum(u.drafted_tokens for u in usage) > 0, drafter  # type: ignore[attr-defined]
        assert sum(u.accepted_tokens for u in usage) > 0, drafter  # type: ignore[attr-defined]


def test_an_unseeded_request_reports_its_seed_and_replays(
    stack: Stack, reference: Reference
) -> None:
    p = prompt(77)
    with Client(stack.address, timeout_s=60) as c:
        first = c.generate(p, max_new_tokens=30, temperature=0.7, top_k=40, k=4, keep_session=True)
        assert first.seed != 0
        assert c.get_session(first.session_id).seed == first.seed
        streamed = list(c.stream(p, max_new_tokens=30, temperature=0.7, top_k=40, seed=first.seed))
        assert {d.seed for d in streamed} == {first.seed}
        assert [t for d in streamed for t in d.token_ids] == first.token_ids
        assert c.close_session(first.session_id)
    want = reference.decode(p, 30, params=SamplingParams(0.7, 40, seed=first.seed))
    assert first.token_ids == want
    assert first.usage.accepted_tokens > 0


def test_the_rejection_rule_is_selectable(stack: Stack) -> None:
    with Client(stack.address, timeout_s=60) as c:
        got = c.generate(
            prompt(3),
            max_new_tokens=20,
            temperature=0.7,
            seed=5,
            k=3,
            rule="rejection",
            keep_session=True,
        )
        info = c.get_session(got.session_id)
        assert info.rule == 2 and info.seed == 5  # SAMPLING_RULE_REJECTION
        record = stored_record(stack.redis_url, got.session_id)
        assert record is not None and record.sampling.rule == 2
        assert c.close_session(got.session_id)


@pytest.fixture
def loaded(stack: Stack) -> Iterator[Stack]:
    """A load curve whose cap is 0 from two sessions on: adaptive sessions draft nothing
    (the curve and its metrics are the orchestrator's: one of its own over the session's
    replicas)."""
    curve = ["--k-full-below", "1", "--k-zero-at", "2"]
    s = Stack(stack.redis_url, orchestrator_args=curve, replicas=stack)
    try:
        yield s.start()
    finally:
        s.stop()


def test_a_requested_k_is_drafted_under_load(loaded: Stack, reference: Reference) -> None:
    k, n = 4, 40
    cases = [(prompt(900 + i), 900 + i) for i in range(4)]

    async def run_all():  # type: ignore[no-untyped-def]
        async with AsyncClient(loaded.address, timeout_s=120) as c:
            return await asyncio.gather(
                *(
                    c.generate(p, max_new_tokens=n, k=k, seed=s, **SAMPLED["model"])
                    for p, s in cases
                )
            )

    for (p, seed), got in zip(cases, asyncio.run(run_all()), strict=True):
        assert got.token_ids == reference.decode(p, n, params=params(SAMPLED["model"], seed))
        u = got.usage
        # k drafts every round, but where fewer than k + 1 tokens were left (at most
        # 1 + 2 + 3 + 4 short over the last rounds).
        assert u.drafted_tokens >= k * u.rounds - 10, u
        assert u.accepted_tokens > 0
    caps = loaded.metric("specserve_orchestrator_k_cap_rounds")
    assert caps.get('{cap="0"}', 0) > 0, caps  # the load cap was 0 in some rounds


def test_a_killed_target_changes_no_sampled_token(two_targets: Stack, reference: Reference) -> None:
    p, seed, n = prompt(31), 31, 300
    expected = reference.decode(p, n, params=params(SAMPLED["model"], seed))
    with Client(two_targets.address, timeout_s=120) as c:
        stream = iter(c.stream(p, max_new_tokens=n, k=4, seed=seed, **SAMPLED["model"]))
        first = next(stream)
        record = stored_record(two_targets.redis_url, first.session_id)
        assert record is not None and record.target.endpoint
        victim = next(t for t in two_targets.target_procs if t.address == record.target.endpoint)
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)
        deltas = [first, *stream]
    assert [t for d in deltas for t in d.token_ids] == expected
    usage = deltas[-1].usage
    assert usage is not None and usage.drafted_tokens > 0 and usage.accepted_tokens > 0
    assert sum(two_targets.metric("specserve_orchestrator_target_failovers").values()) >= 1


def test_a_restarted_orchestrator_continues_with_the_same_tokens(
    redis_url: str, reference: Reference
) -> None:
    stack = Stack(redis_url)
    try:
        stack.start()
        p, seed = prompt(61), 61
        with Client(stack.address, timeout_s=60) as c:
            t1 = c.generate(
                p, max_new_tokens=24, k=3, seed=seed, keep_session=True, **SAMPLED["model"]
            )
        assert stack.orchestrator is not None
        args = list(stack.orchestrator.args)
        stack.metrics_port = free_port()
        args[args.index("--metrics-port") + 1] = str(stack.metrics_port)
        stack.orchestrator.stop()
        stack.orchestrator = OrchestratorProcess(args, env=stack.orchestrator.env)
        stack.orchestrator.start().wait_serving()
        with Client(stack.address, timeout_s=60) as c:  # no seed: the session's
            t2 = c.generate(
                [5, 6], session_id=t1.session_id, max_new_tokens=24, k=5, **SAMPLED["model"]
            )
        sampled = params(SAMPLED["model"], seed)
        assert t1.token_ids == reference.decode(p, 24, params=sampled)
        assert t2.seed == seed
        assert t2.token_ids == reference.decode([*p, *t1.token_ids, 5, 6], 24, params=sampled)
        assert t1.usage.accepted_tokens > 0 and t2.usage.accepted_tokens > 0
    finally:
        stack.stop()
