"""Session state in Redis, end to end: written as deltas, and riding out a Redis restart.

One stack on its own redis-server (its traffic is measured and it is restarted),
with data that survive a restart as a production Redis's do (RDB at shutdown).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from specserve.client import Client
from specserve.orchestrator.store import keys
from specserve.v1 import generate_pb2
from tests.orchestrator.redis_server import RestartableRedis, restartable_redis
from tests.orchestrator.stack import Reference, Stack, redis_keys, stored_record

pytestmark = pytest.mark.redis

PROMPT = [21, 22, 23, 24, 21, 22, 23, 24]


@pytest.fixture(scope="module")
def redis_and_stack() -> Iterator[tuple[RestartableRedis, Stack]]:
    with restartable_redis() as redis:
        stack = Stack(redis.url)
        try:
            yield redis, stack.start()
        finally:
            stack.stop()


def test_stop_strings_are_written_once_not_every_round(
    redis_and_stack: tuple[RestartableRedis, Stack],
) -> None:
    """16 stop strings of 1000 bytes and a 1000-token prompt: each round adds its token
    and a few small fields to the record, not the ~18 KB of constant fields again."""
    redis, stack = redis_and_stack
    stop = [f"{i:02d}" + "~" * 998 for i in range(16)]
    prompt = [(7 * i) % 200 + 1 for i in range(1000)]
    with Client(stack.address, timeout_s=60) as c:
        before = redis.bytes_in()
        done = c.generate(prompt, max_new_tokens=64, stop=stop, drafter="none")
        sent = redis.bytes_in() - before
    assert done.finish_reason == "length" and done.usage.rounds >= 60
    constant = sum(len(s) for s in stop)
    per_round = (sent - constant) / done.usage.rounds
    print(f"bytes sent to Redis: {sent} for {done.usage.rounds} rounds, {per_round:.0f} a round")
    assert sent < 2 * constant + 64 * 1024  # the stop strings went in once (with the turn)
    # Measured about 0.9 KB (the commit script's keys and arguments); before deltas each
    # round rewrote the whole record, stop strings and prompt included: about 18 KB.
    assert per_round < 2048


@dataclass
class Consumer:
    """One stream read to its end on a thread: its tokens, its largest gap, its error."""

    prompt: list[int]
    keep: bool
    address: str
    tokens: list[int] = field(default_factory=list)
    session_id: str = ""
    finish: str | None = None
    error: BaseException | None = None
    largest_gap_s: float = 0.0
    started: threading.Event = field(default_factory=threading.Event)

    def run(self, n_tokens: int) -> None:
        try:
            with Client(self.address, timeout_s=60) as c:
                last = time.monotonic()
                deltas = c.stream(
                    self.prompt, max_new_tokens=n_tokens, drafter="none", keep_session=self.keep
                )
                for d in deltas:
                    now = time.monotonic()
                    if self.started.is_set():
                        self.largest_gap_s = max(self.largest_gap_s, now - last)
                    last = now
                    self.session_id = d.session_id
                    self.tokens.extend(d.token_ids)
                    self.finish = d.finish_reason or self.finish
                    self.started.set()
        except BaseException as e:  # the assertion below reports it
            self.error = e
        finally:
            self.started.set()


def test_a_redis_restart_loses_no_stream_and_leaves_nothing_active(
    redis_and_stack: tuple[RestartableRedis, Stack], reference: Reference
) -> None:
    """Redis goes down for 3 s under four streams: each pauses, then finishes whole and
    right; kept sessions end IDLE, the others leave nothing behind."""
    redis, stack = redis_and_stack
    n = 400
    prompts = [[*PROMPT, i] for i in range(4)]
    streams = [Consumer(p, keep=i % 2 == 0, address=stack.address) for i, p in enumerate(prompts)]
    threads = [threading.Thread(target=s.run, args=(n,)) for s in streams]
    for t in threads:
        t.start()
    for s in streams:
        assert s.started.wait(30)
    redis.stop()
    time.sleep(3.0)
    redis.start()
    for t in threads:
        t.join(60)
    for s in streams:
        assert s.error is None, s.error
        assert s.finish == "length" and len(s.tokens) == n
        assert s.tokens == reference.decode(s.prompt, n)
        assert s.largest_gap_s >= 2.0  # it was in flight across the outage
    for s in streams:
        record = stored_record(stack.redis_url, s.session_id)
        if s.keep:
            assert record is not None and record.state == generate_pb2.SESSION_STATE_IDLE
            assert len(record.tokens) == len(s.prompt) + n
        else:
            assert record is None
    left = [k for k in redis_keys(stack.redis_url) if not k.startswith(keys.KV_PREFIX)]
    kept = {keys.session_key(s.session_id) for s in streams if s.keep}
    assert set(left) == kept  # no lease, no cancel flag, no record of a finished stream
    with Client(stack.address, timeout_s=30) as c:
        for s in streams:
            if s.keep:
                assert c.close_session(s.session_id)
