"""A long prompt never freezes the other streams on its target (issue 46): end to end.

A stack of real processes on real Redis (tiny models, one torch thread each, devices
declared shared, as on the test machine: a plain round is one step). Two short
sessions stream; then a prompt of :data:`LONG` tokens arrives on the same target.
Prefilled in one round it held both streams for the whole prefill (see
docs/scheduling.md for the figures); prefilled in chunks sized from a fitted cost at
their position, the streams' largest gap while it prefills stays within
:data:`BOUND` times their normal gap, the prompt went in several chunks, and its
tokens are those of the local engine's target-only decoding.
"""

from __future__ import annotations

import itertools
import random
import statistics
import threading
import time
from collections.abc import Iterator

import pytest

from specserve.client import Client
from tests.orchestrator.stack import Reference, Stack

pytestmark = pytest.mark.redis

LONG = 3_000  # tokens: prefilled in one round, the others wait ~110 normal gaps
# The others' largest gap while it prefills, in normal gaps. Issue 46 asks for 3; a chunk
# round is sized to take about two usual rounds (fleet/prefill_budget.py), and on this
# 2-core host the rest is its noise: the normal gap is 2-8 ms, and the streams' largest
# gap with no prompt at all reached 2-7x of it (bench/results/long_prompt_fairness.md).
# Measured 5.3x here (the cap-sized first chunk before: 5.6x); this bound keeps what
# holds on a busy host and fails the one-round prefill (110x) by far.
BOUND = 12.0
SHORT = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]


@pytest.fixture(scope="module")
def shared_stack(redis_url: str) -> Iterator[Stack]:
    """A stack whose target holds 64k tiny-model tokens, devices declared shared."""
    s = Stack(
        redis_url,
        orchestrator_args=["--devices", "shared"],
        target_args=[["--kv-budget", "32MiB"]],
    )
    try:
        yield s.start()
    finally:
        s.stop()


class Timed(threading.Thread):
    """Streams one request and notes when each delta arrived, until told to stop."""

    def __init__(self, client: Client, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.stream = client.stream(prompt, max_new_tokens=4000, drafter="none", ignore_eos=True)
        self.times: list[float] = []
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            for _ in self.stream:
                self.times.append(time.monotonic())
        except Exception as e:  # cancelled once the test is over; else it fails
            self.error = e

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between deltas that arrived in ``start .. end`` (the first one's from its
        predecessor too)."""
        return [b - a for a, b in itertools.pairwise(self.times) if start < b <= end]


def test_a_long_prompt_does_not_freeze_the_other_streams(
    shared_stack: Stack, reference: Reference
) -> None:
    rng = random.Random(46)
    long_prompt = [rng.randrange(256) for _ in range(LONG)]
    with Client(shared_stack.address, timeout_s=120) as c:
        streams = [Timed(c, p) for p in SHORT]
        for s in streams:
            s.start()
        while min(len(s.times) for s in streams) < 100:  # the lane's rounds are measured
            assert all(s.is_alive() for s in streams), [s.error for s in streams]
            time.sleep(0.01)
        normal_from = time.monotonic()
        time.sleep(0.5)
        t0 = time.monotonic()
        done = c.generate(long_prompt, max_new_tokens=8, drafter="none")
        t1 = time.monotonic()
        assert all(s.is_alive() for s in streams), [s.error for s in streams]
        for s in streams:
            s.stream.cancel()
            s.join(timeout=10)
    normal = statistics.median(g for s in streams for g in s.gaps(normal_from, t0))
    worst = max(g for s in streams for g in s.gaps(t0, t1))
    print(
        f"\n{LONG}-token prompt: time to first token {done.time_to_first_token_s:.2f} s; "
        f"the other streams' normal gap {normal * 1e3:.1f} ms, largest while it "
        f"prefilled {worst * 1e3:.1f} ms ({worst / normal:.1f}x)"
    )
    assert done.token_ids == reference.decode(long_prompt, 8)
    chunks = shared_stack.metric("specserve_orchestrator_prefill_chunks")
    assert sum(chunks.values()) >= 2  # it was prefilled over several rounds
    assert worst <= BOUND * normal, f"a stream waited {worst / normal:.1f} normal gaps"
