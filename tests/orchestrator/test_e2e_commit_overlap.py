"""A round's commit overlaps the next round's Propose, and stays lossless when it fails.

An orchestrator in this process (so its store can be made to fail at a chosen
round) over a tiny target and draft in child processes and the real Redis. The
fault is injected into the pipeline that carries a round's commit script:

* the reply is lost after Redis applied the commit (the store retries; the
  idempotent script finds its own bytes);
* Redis refuses the call before applying it (the store retries);
* another writer bumped the record's version (the commit conflicts);
* Redis answers with an error no retry mends (the store gives up at once).

In every case the client never holds a token the store lacks, and no round is
written twice: the stored completion equals what the client received.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from specserve.client import AsyncClient
from specserve.orchestrator import app as orchestrator_app
from specserve.orchestrator import config
from specserve.orchestrator.round import calls
from specserve.orchestrator.store.session_store import SessionStore
from specserve.serving.launch import ServerProcess
from tests.orchestrator.stack import DRAFT, ENV, SERVER_ARGS, TARGET, Reference

pytestmark = pytest.mark.redis

PROMPT = [41, 42, 43, 44, 41, 42, 43, 44]
N = 48  # tokens generated per test
FAIL_AT = 3  # the commit (of the session's 3rd round) the fault hits


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[str, str]]:
    """(target address, draft address) of a tiny pair in child processes."""
    target = ServerProcess("target", ["--model", TARGET, *SERVER_ARGS], env=ENV)
    draft = ServerProcess("draft", ["--model", DRAFT, *SERVER_ARGS], env=ENV)
    try:
        for s in (target, draft):  # generous: the test machine may be busy
            s.start(timeout_s=300)
        for s in (target, draft):
            s.wait_serving(timeout_s=300)
        yield target.address, draft.address
    finally:
        target.stop()
        draft.stop()


@dataclass
class CommitFaults:
    """Wraps a store's commit script: counts the pipelines that carry it, times them, and
    makes commit number ``fail_at`` fail as ``mode`` says (None: never)."""

    store: SessionStore
    mode: str | None = None
    fail_at: int = FAIL_AT
    delay_s: float = 0.0  # each commit takes this much longer (a slower Redis)
    commits: int = 0
    spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end) each

    def __post_init__(self) -> None:
        self.script = self.store._commit
        self.store._commit = self  # type: ignore[assignment]
        self._armed: set[int] = set()

    async def __call__(self, *, keys: list[str], args: list[Any], client: Any) -> Any:
        await self.script(keys=keys, args=args, client=client)
        if id(client) not in self._armed:
            self._armed.add(id(client))
            client.execute = self._execute(client.execute, keys[0])

    def _execute(self, run: Any, session_key: str) -> Any:
        async def execute(*a: Any, **kw: Any) -> Any:
            self.commits += 1
            failing = self.commits == self.fail_at
            start = time.perf_counter()
            try:
                if failing and self.mode == "refused":
                    raise RedisConnectionError("injected: connection refused before the commit")
                if failing and self.mode == "error":
                    raise ResponseError("injected: an error no retry mends")
                if failing and self.mode == "conflict":  # another orchestrator wrote it
                    await self.store.redis.hincrby(session_key, "v", 100)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                result = await run(*a, **kw)
                if failing and self.mode == "lost_reply":
                    raise RedisConnectionError("injected: the commit's reply was lost")
                return result
            finally:
                self.spans.append((start, time.perf_counter()))

        return execute


async def start_orchestrator(replicas: tuple[str, str], redis_url: str) -> Any:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, {})
    target, draft = replicas
    argv = ["--target", target, "--draft", draft, "--redis-url", redis_url, "--port", "0"]
    return await orchestrator_app.start(config.from_args(parser.parse_args(argv)))


@dataclass
class Turn:
    tokens: list[int] = field(default_factory=list)
    session_id: str = ""
    finish: str | None = None
    error: grpc.aio.AioRpcError | None = None
    drafted: int = 0
    accepted: int = 0


async def stream(
    address: str, prompt: list[int], n: int, drafter: str = "model", **kwargs: Any
) -> Turn:
    turn = Turn()
    client = AsyncClient(address, timeout_s=120)
    k = 4 if drafter != "none" else 0
    try:
        async for d in client.stream(prompt, max_new_tokens=n, drafter=drafter, k=k, **kwargs):
            turn.tokens.extend(d.token_ids)
            turn.session_id = d.session_id or turn.session_id
            turn.finish = d.finish_reason or turn.finish
            if d.usage is not None:
                turn.drafted, turn.accepted = d.usage.drafted_tokens, d.usage.accepted_tokens
    except grpc.aio.AioRpcError as e:
        turn.error = e
    finally:
        await client.close()
    return turn


def run_with_faults(
    replicas: tuple[str, str],
    redis_url: str,
    mode: str | None,
    *,
    delay_s: float = 0.0,
    then_continue: bool = False,
    drafter: str = "model",
) -> tuple[Turn, Turn | None, CommitFaults, list[int], dict[str, list[tuple[float, float]]]]:
    """One kept streamed turn with a fault at commit FAIL_AT (and, if asked, a second turn
    continuing the session); returns the turns, the faults, the stored tokens and the
    (start, end) of every Propose and every Verify the orchestrator made."""

    async def body() -> tuple[Turn, Turn | None, CommitFaults, list[int], dict[str, Any]]:
        app = await start_orchestrator(replicas, redis_url)
        faults = CommitFaults(app.store, mode, delay_s=delay_s)
        timed: dict[str, list[tuple[float, float]]] = {"propose": [], "verify": []}
        real = {name: getattr(calls, name) for name in timed}

        def timing(name: str) -> Any:
            async def call(*a: Any, **kw: Any) -> Any:
                start = time.perf_counter()
                try:
                    return await real[name](*a, **kw)
                finally:
                    timed[name].append((start, time.perf_counter()))

            return call

        for name in timed:
            setattr(calls, name, timing(name))
        try:
            first = await stream(app.address, PROMPT, N, drafter, keep_session=True)
            second = None
            if then_continue and first.session_id:
                left = N - len(first.tokens)
                second = await stream(
                    app.address, [], left, drafter, session_id=first.session_id, keep_session=True
                )
            record = await app.store.get(first.session_id)
            stored = [] if record is None else list(record.tokens)[len(PROMPT) :]
            client = AsyncClient(app.address, timeout_s=30)
            try:
                await client.close_session(first.session_id)
            except grpc.aio.AioRpcError:  # taken over (the conflict case): not ours to close
                await app.store.delete(first.session_id)
            finally:
                await client.close()
            return first, second, faults, stored, timed
        finally:
            for name, call in real.items():
                setattr(calls, name, call)
            await app.close()

    return asyncio.run(body())


def overlapped(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> int:
    """How many intervals of ``a`` overlap some interval of ``b``."""
    return sum(1 for s, e in a if any(s < e2 and s2 < e for s2, e2 in b))


def test_a_rounds_commit_runs_while_the_next_round_proposes(
    replicas: tuple[str, str], redis_url: str, reference: Reference
) -> None:
    """With commits 30 ms slower than usual, the next round's Propose is out while one
    is in flight, and the greedy output is still the target's, drafts accepted."""
    turn, _, faults, stored, timed = run_with_faults(replicas, redis_url, None, delay_s=0.03)
    assert turn.error is None and turn.finish == "length"
    assert turn.tokens == reference.decode(PROMPT, N)
    assert turn.drafted > 0 and turn.accepted > 0
    assert stored == turn.tokens
    proposes = timed["propose"]
    both = overlapped(faults.spans, proposes)
    print(f"{both} of {len(faults.spans)} commits overlapped a Propose ({len(proposes)} in all)")
    # Before the overlap every commit ended before the next round's Propose began.
    assert both >= len(faults.spans) // 2


def test_a_plain_rounds_commit_runs_while_the_next_round_verifies(
    replicas: tuple[str, str], redis_url: str, reference: Reference
) -> None:
    """Plain decoding (no Propose to hide it behind): with commits 30 ms slower than
    usual, the next round's Verify is out while one is in flight, and the greedy output
    and the stored tokens are still the target's."""
    turn, _, faults, stored, timed = run_with_faults(
        replicas, redis_url, None, delay_s=0.03, drafter="none"
    )
    assert turn.error is None and turn.finish == "length"
    assert turn.tokens == reference.decode(PROMPT, N)
    assert stored == turn.tokens
    assert not timed["propose"] and turn.drafted == 0
    both = overlapped(faults.spans, timed["verify"])
    print(f"{both} of {len(faults.spans)} commits overlapped a Verify")
    # Before, every commit settled before the next round's Verify was sent.
    assert both >= len(faults.spans) // 2


@pytest.mark.parametrize("mode", ["lost_reply", "refused"])
def test_a_commit_retried_after_a_transient_failure_is_written_once(
    replicas: tuple[str, str], redis_url: str, reference: Reference, mode: str
) -> None:
    """A commit whose reply was lost (applied) or that was refused (not applied) is sent
    again: the stream goes on unchanged and the round's tokens are stored once."""
    turn, _, faults, stored, _ = run_with_faults(replicas, redis_url, mode)
    assert faults.commits > FAIL_AT  # the fault fired and decoding went on
    assert turn.error is None and turn.finish == "length"
    assert turn.tokens == reference.decode(PROMPT, N)
    assert turn.drafted > 0 and turn.accepted > 0
    assert stored == turn.tokens  # not a token twice, not one missing


@pytest.mark.parametrize("drafter", ["model", "none"])
def test_a_conflicting_commit_stops_the_session_with_only_stored_tokens_sent(
    replicas: tuple[str, str], redis_url: str, reference: Reference, drafter: str
) -> None:
    """Another writer took the record over before round 3's commit: the client gets
    ABORTED after exactly the tokens of the rounds that were stored, and this
    orchestrator never writes the session again (the next round, verified while the
    commit was in flight, is dropped)."""
    turn, _, faults, stored, _ = run_with_faults(replicas, redis_url, "conflict", drafter=drafter)
    assert turn.error is not None and turn.error.code() == grpc.StatusCode.ABORTED
    assert 0 < len(turn.tokens) < N
    assert turn.tokens == stored == reference.decode(PROMPT, N)[: len(turn.tokens)]
    assert faults.commits == FAIL_AT  # no commit after the conflict, no final record


def test_a_commit_the_store_refuses_ends_the_turn_and_the_session_continues_unchanged(
    replicas: tuple[str, str], redis_url: str, reference: Reference
) -> None:
    """Redis refuses round 3's commit for good: the turn ends UNAVAILABLE after the
    stored rounds' tokens; continuing the kept session replays from the store and the
    two turns together are the uninterrupted output."""
    first, second, _, stored, _ = run_with_faults(replicas, redis_url, "error", then_continue=True)
    assert first.error is not None and first.error.code() == grpc.StatusCode.UNAVAILABLE
    assert 0 < len(first.tokens) < N
    assert second is not None and second.error is None and second.finish == "length"
    assert first.tokens + second.tokens == reference.decode(PROMPT, N)
    assert stored == first.tokens + second.tokens
