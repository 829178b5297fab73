"""A slow host fails no request; a stopped target still fails over when it can.

The throttle is real and made to be far worse than the stall time: the lone
target's process is stopped (SIGSTOP) for 1.2 s out of every 1.5 s while a busy
process competes for the CPU, and the orchestrator runs with ``--target-stall-s
0.5`` (``--target-timeout-s 3``: a Verify may span a stop and a run). When a stall
was a timer, the lone target was declared stalled at its first stop and its sessions
failed over: back to it after its backoff, their KV rebuilt (3 failovers for the 3
requests here), or ``UNAVAILABLE`` once none came back within ``--failover-s``. Now
it keeps its requests, and each answer equals the target-only reference token for
token. ``-s`` prints the idle and throttled times (docs/robustness.md quotes them).

With a second target, a target stopped for good (SIGSTOP, no SIGCONT) is a fact
the orchestrator can act on: the request moves to the other one, unchanged.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from specserve.client import Client
from tests.orchestrator.stack import Reference, Stack, stored_record

pytestmark = pytest.mark.redis

PROMPTS = [[11, 12, 13, 14, 11, 12, 13, 14], [5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 40, 41]]
TOKENS = 48
STALL = ["--target-stall-s", "0.5", "--target-timeout-s", "3", "--failover-s", "2"]


class DutyCycle:
    """Stop a process for ``stopped_s`` out of every ``stopped_s + running_s`` (a thread)."""

    def __init__(self, proc: subprocess.Popen[bytes], stopped_s: float, running_s: float) -> None:
        self.proc, self.stopped_s, self.running_s = proc, stopped_s, running_s
        self.stopping = threading.Event()
        self.cycles = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopping.is_set():
            self.proc.send_signal(signal.SIGSTOP)
            self.stopping.wait(self.stopped_s)
            self.proc.send_signal(signal.SIGCONT)
            self.cycles += 1
            self.stopping.wait(self.running_s)

    def __enter__(self) -> DutyCycle:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.thread.join()
        self.proc.send_signal(signal.SIGCONT)


@pytest.fixture
def busy_competitor() -> Iterator[subprocess.Popen[bytes]]:
    """A process that spins on a core for as long as the test runs."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield spinner
    finally:
        spinner.kill()
        spinner.wait()


def test_a_throttled_lone_target_completes_every_request(
    redis_url: str, reference: Reference, busy_competitor: subprocess.Popen[bytes]
) -> None:
    expected = [reference.decode(p, TOKENS) for p in PROMPTS]
    stack = Stack(redis_url, orchestrator_args=STALL).start()
    try:
        target = stack.target_procs[0].proc
        assert target is not None
        with Client(stack.address, timeout_s=120) as c:
            t0 = time.monotonic()
            idle = [c.generate(p, max_new_tokens=TOKENS, k=4).token_ids for p in PROMPTS]
            idle_s = time.monotonic() - t0
            assert idle == expected
            passes = []  # the prompts again until the requests lived through 3 stops
            with DutyCycle(target, stopped_s=1.2, running_s=0.3) as throttle:
                while not passes or throttle.cycles < 3:
                    passes.append([c.generate(p, max_new_tokens=TOKENS, k=4) for p in PROMPTS])
            throttled_s = time.monotonic() - t0 - idle_s
        print(
            f"\n{len(PROMPTS)} requests: idle {idle_s:.2f} s; throttled {len(passes)} times "
            f"over {throttled_s:.2f} s"
        )
        for throttled in passes:
            assert [r.token_ids for r in throttled] == expected
            assert all(r.usage.accepted_tokens > 0 for r in throttled)
        failovers = stack.metric("specserve_orchestrator_target_failovers")
        assert sum(failovers.values()) == 0
    finally:
        stack.stop()


def test_a_stopped_target_fails_over_when_another_exists(
    redis_url: str, reference: Reference
) -> None:
    expected = reference.decode(PROMPTS[0], 200)
    stack = Stack(redis_url, targets=2, orchestrator_args=STALL).start()
    victim = None
    try:
        with Client(stack.address, timeout_s=120) as c:
            stream = iter(c.stream(PROMPTS[0], max_new_tokens=200, k=4))
            first = next(stream)
            record = stored_record(redis_url, first.session_id)
            assert record is not None and record.target.endpoint
            victim = next(t for t in stack.target_procs if t.address == record.target.endpoint)
            assert victim.proc is not None
            victim.proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            deltas = [first, *stream]
            took = time.monotonic() - t0
        assert [t for d in deltas for t in d.token_ids] == expected
        assert took < 30  # the stall time and a replay, not a timeout chain
        failovers = stack.metric("specserve_orchestrator_target_failovers")
        assert sum(failovers.values()) >= 1
    finally:
        if victim is not None and victim.proc is not None:
            victim.proc.send_signal(signal.SIGCONT)
        stack.stop()
