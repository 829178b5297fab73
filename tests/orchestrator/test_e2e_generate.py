"""End to end over real processes: client -> orchestrator -> draft + target, state in real Redis.

Greedy output through the whole stack must equal target-only decoding in this
process, with drafts proposed and accepted; sessions carry over turns; many
concurrent sessions batch on the target and leave nothing behind.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest

from specserve.client import AsyncClient, Client
from specserve.engine.sampling import SamplingParams
from tests.orchestrator.stack import Reference, Stack, kv_used, redis_keys, stored_record

pytestmark = pytest.mark.redis


def prompt(seed: int, n: int = 6) -> list[int]:
    rng = random.Random(seed)
    base = [rng.randrange(256) for _ in range(n)]
    return base * 3  # repetition gives the n-gram drafter something to find


def wait_until(check, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.mark.parametrize(("drafter", "k"), [("model", 4), ("ngram", 3)])
def test_unary_greedy_equals_target_only(
    stack: Stack, reference: Reference, drafter: str, k: int | None
) -> None:
    p = prompt(1)
    expected = reference.decode(p, 40)
    with Client(stack.address, timeout_s=60) as c:
        got = c.generate(p, max_new_tokens=40, drafter=drafter, k=k)
    assert got.token_ids == expected
    assert got.finish_reason == "length"
    assert got.usage.completion_tokens == 40 and got.usage.prompt_tokens == len(p)
    assert got.usage.drafted_tokens > 0 and got.usage.accepted_tokens > 0
    assert got.usage.rounds < 40  # speculation saved target forwards
    assert got.text == "".join(f" {t}" for t in expected)  # no tokenizer: ids as text


@pytest.fixture
def fresh(stack: Stack) -> Iterator[Stack]:
    """An orchestrator of its own over the session's replicas, as a new deployment's
    first request meets the default policy (its rounds over the data-plane sockets, its
    one transport).

    The session's shared orchestrator has learnt every earlier test's rounds, and on two
    shared cores with a draft as large as its target its planner rightly stops drafting,
    so only a fresh orchestrator (the planner's state is the orchestrator's alone) can
    be asked to draft at adaptive k.
    """
    s = Stack(stack.redis_url, replicas=stack)
    try:
        yield s.start()
    finally:
        s.stop()


def test_a_fresh_stacks_first_request_speculates_at_adaptive_k(
    fresh: Stack, reference: Reference
) -> None:
    p = prompt(1)
    expected = reference.decode(p, 40)
    with Client(fresh.address, timeout_s=60) as c:
        got = c.generate(p, max_new_tokens=40, drafter="model")  # k unset: the default policy
    assert got.token_ids == expected
    assert got.usage.drafted_tokens > 0 and got.usage.accepted_tokens > 0
    assert got.usage.rounds < 40  # speculation saved target forwards


@pytest.fixture(scope="module")
def measured(stack: Stack) -> Iterator[Stack]:
    """An orchestrator of its own on the default policy, over the session's replicas:
    its metrics count this module's rounds alone."""
    s = Stack(stack.redis_url, replicas=stack)
    try:
        yield s.start()
    finally:
        s.stop()


def test_a_long_prompt_warms_the_draft_beside_the_rounds(
    measured: Stack, reference: Reference
) -> None:
    p = prompt(9, n=14)  # 42 tokens: more than a round's Propose may make the draft prefill
    expected = reference.decode(p, 40)
    stack = measured
    with Client(stack.address, timeout_s=60) as c:
        got = c.generate(p, max_new_tokens=40, k=4)
    assert got.token_ids == expected
    assert got.usage.drafted_tokens > 0 and got.usage.accepted_tokens > 0
    assert sum(stack.metric("specserve_orchestrator_draft_warmups").values()) >= 1
    caps = stack.metric("specserve_orchestrator_k_cap_rounds")  # the measured cap at work
    assert sum(caps.values()) > 0 and any(v > 0 for k, v in caps.items() if 'cap="0"' not in k)


def test_prompts_past_the_prefill_budget_wait_their_turn(
    stack: Stack, reference: Reference
) -> None:
    """Four 42-token prompts at once on a 40-token budget: one prefill per round, all exact
    (the budget is the orchestrator's: one of its own over the session's replicas)."""
    prompts = [prompt(30 + i, n=14) for i in range(4)]
    want = [reference.decode(p, 12) for p in prompts]
    budget = ["--max-prefill-tokens", "40"]
    budgeted = Stack(stack.redis_url, orchestrator_args=budget, replicas=stack).start()
    try:

        async def run_all() -> list[list[int]]:
            async with AsyncClient(budgeted.address, timeout_s=120) as c:
                outs = await asyncio.gather(
                    *(c.generate(p, max_new_tokens=12, k=3) for p in prompts)
                )
            return [o.token_ids for o in outs]

        assert asyncio.run(run_all()) == want
    finally:
        budgeted.stop()


def test_stream_equals_unary_and_text_adds_up(stack: Stack, reference: Reference) -> None:
    p = prompt(2)
    expected = reference.decode(p, 30)
    with Client(stack.address, timeout_s=60) as c:
        deltas = list(c.stream(p, max_new_tokens=30, k=4))
    assert [t for d in deltas for t in d.token_ids] == expected
    assert "".join(d.text for d in deltas) == "".join(f" {t}" for t in expected)
    assert deltas[-1].finish_reason == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert len(deltas) > 2  # tokens arrived round by round
    last = deltas[-1].usage
    assert last is not None and last.accepted_tokens > 0


def test_stop_string_ends_the_text(stack: Stack, reference: Reference) -> None:
    p = prompt(3)
    expected = reference.decode(p, 20)
    stop = f" {expected[5]} {expected[6]}"
    with Client(stack.address, timeout_s=60) as c:
        got = c.generate(p, max_new_tokens=20, stop=[stop], k=3)
    assert got.finish_reason == "stop"
    full = "".join(f" {t}" for t in expected)
    assert got.text == full[: full.index(stop)]


def test_multi_turn_session(stack: Stack, reference: Reference) -> None:
    p1, p2 = prompt(4), [7, 8, 9, 7, 8, 9]
    first = reference.decode(p1, 16)
    second = reference.decode([*p1, *first, *p2], 16)
    before = redis_keys(stack.redis_url)
    with Client(stack.address, timeout_s=60) as c:
        t1 = c.generate(p1, max_new_tokens=16, k=4, keep_session=True)
        assert t1.token_ids == first
        sid = t1.session_id
        info = c.get_session(sid)
        assert (info.tokens, info.turns, info.state) == (len(p1) + 16, 1, 2)  # 2 = IDLE
        record = stored_record(stack.redis_url, sid)
        assert record.target.endpoint and record.target.tokens > 0  # KV kept warm
        t2 = c.generate(p2, max_new_tokens=16, k=4, session_id=sid, keep_session=True)
        assert t2.session_id == sid and t2.token_ids == second
        assert t2.usage.accepted_tokens > 0
        info = c.get_session(sid)
        assert info.turns == 2 and info.tokens == len(p1) + 16 + len(p2) + 16
        assert info.usage.completion_tokens == 32
        # A third turn that does not keep the session ends it.
        t3 = c.generate([5], max_new_tokens=4, session_id=sid)
        assert len(t3.token_ids) == 4
        assert redis_keys(stack.redis_url) == before
    wait_until(lambda: kv_used(stack.target_procs[0].address, "target")[0] == 0)


def test_close_session_frees_everything(stack: Stack) -> None:
    before = redis_keys(stack.redis_url)
    with Client(stack.address, timeout_s=60) as c:
        sid = c.generate(prompt(5), max_new_tokens=8, keep_session=True).session_id
        assert len(redis_keys(stack.redis_url)) == len(before) + 1
        assert c.close_session(sid)
        assert redis_keys(stack.redis_url) == before
    wait_until(lambda: kv_used(stack.target_procs[0].address, "target")[0] == 0)


def test_sixteen_concurrent_sessions(stack: Stack, reference: Reference) -> None:
    """Mixed drafters, k and sampling; all correct; Verify batched; nothing left behind."""
    assert stack.draft is not None
    target, draft = stack.target_procs[0].address, stack.draft.address
    base_target, base_draft = kv_used(target, "target"), kv_used(draft, "draft")
    keys_before = redis_keys(stack.redis_url)
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.95)
    cases = []
    for i in range(16):
        kind = i % 4
        p = prompt(100 + i, n=4 + i % 5)
        n = 24 + 4 * (i % 3)
        if kind == 0:  # greedy, model drafter, fixed k
            cases.append((p, n, {"k": 3}, reference.decode(p, n)))
        elif kind == 1:  # greedy, adaptive k
            cases.append((p, n, {"drafter": "ngram"}, reference.decode(p, n)))
        elif kind == 2:  # sampled, n-gram drafter, fixed k: reproduces the local engine
            seed = 1000 + i
            want = reference.decode(
                p, n, drafter="ngram", k=2, params=SamplingParams(0.8, 20, 0.95, seed)
            )
            kw = {
                "drafter": "ngram",
                "k": 2,
                "temperature": 0.8,
                "top_k": 20,
                "top_p": 0.95,
                "seed": seed,
            }
            cases.append((p, n, kw, want))
        else:  # sampled target-only
            seed = 2000 + i
            want = reference.decode(p, n, params=SamplingParams(0.8, 20, 0.95, seed))
            kw = {"drafter": "none", "temperature": 0.8, "top_k": 20, "top_p": 0.95, "seed": seed}
            cases.append((p, n, kw, want))
    del sampled

    async def run_all():  # type: ignore[no-untyped-def]
        async with AsyncClient(stack.address, timeout_s=120) as c:

            async def one(p, n, kw):  # type: ignore[no-untyped-def]
                out, usage = [], None
                async for d in c.stream(p, max_new_tokens=n, **kw):
                    out.extend(d.token_ids)
                    usage = d.usage or usage
                return out, usage

            return await asyncio.gather(*(one(p, n, kw) for p, n, kw, _ in cases))

    got = asyncio.run(run_all())
    for (_, _, kw, want), (tokens, _) in zip(cases, got, strict=True):
        assert tokens == want, kw
    # A requested k is drafted whatever the load: those sessions proposed and had accepted.
    asked = [u for (_, _, kw, _), (_, u) in zip(cases, got, strict=True) if "k" in kw]
    assert sum(u.drafted_tokens for u in asked) > 0
    assert sum(u.accepted_tokens for u in asked) > 0
    batches = stack.metric("specserve_orchestrator_verify_calls")
    sizes = [int(label.split('"')[1]) for label in batches]
    assert max(sizes) > 1, batches
    wait_until(lambda: kv_used(target, "target") == base_target)
    wait_until(lambda: kv_used(draft, "draft") == base_draft)
    assert redis_keys(stack.redis_url) == keys_before
