"""Leases and stall detection end to end: a dead orchestrator's sessions and a hung target's
sessions move on within seconds (the lease, --target-stall-s), not minutes.

Both use the defaults (a 5 s lease, a 5 s stall time), so each test takes a few seconds.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from specserve.client import Client
from specserve.orchestrator.launch import OrchestratorProcess
from specserve.v1 import generate_pb2
from tests.orchestrator.stack import ENV, Reference, Stack, kv_used, stored_record

pytestmark = pytest.mark.redis

PROMPT = [31, 32, 33, 34, 31, 32, 33, 34]
LEASE_S = 5.0  # the default --session-lease-s
STALL_S = 5.0  # the default --target-stall-s


@pytest.fixture
def doomed(stack: Stack) -> Iterator[OrchestratorProcess]:
    """A second orchestrator over the shared stack's replicas and Redis, to be SIGKILLed."""
    assert stack.draft is not None
    args = ["--target", stack.target_procs[0].address, "--draft", stack.draft.address]
    proc = OrchestratorProcess([*args, "--redis-url", stack.redis_url], env=ENV)
    try:
        proc.start().wait_serving()
        yield proc
    finally:
        proc.stop()


def test_a_killed_orchestrators_sessions_are_usable_within_the_lease(
    stack: Stack, doomed: OrchestratorProcess
) -> None:
    """Three kept sessions generating on an orchestrator that is SIGKILLed: within the
    lease the other orchestrator continues one, cancels one and closes one."""
    with Client(doomed.address, timeout_s=60) as c:
        streams = [
            iter(c.stream([*PROMPT, i], max_new_tokens=4000, drafter="none", keep_session=True))
            for i in range(3)
        ]
        ids = [next(s).session_id for s in streams]
        assert doomed.proc is not None
        doomed.proc.kill()
        killed = time.monotonic()
    go_on, cancel, close = ids
    with Client(stack.address, timeout_s=30) as c:
        while True:  # busy while the lease lasts, then usable
            try:
                more = c.generate([3, 4], session_id=go_on, max_new_tokens=5, keep_session=True)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
                assert time.monotonic() - killed < LEASE_S + 2.0
                time.sleep(0.1)
        took = time.monotonic() - killed
        print(f"the session was continued {took:.2f} s after its orchestrator was killed")
        assert took < LEASE_S + 2.0  # before leases: 120 s
        assert more.finish_reason == "length" and len(more.token_ids) == 5
        assert c.get_session(cancel).state == generate_pb2.SESSION_STATE_IDLE  # nothing runs it
        assert c.cancel(cancel)
        record = stored_record(stack.redis_url, cancel)
        assert record is not None and record.state == generate_pb2.SESSION_STATE_CANCELLED
        assert c.close_session(close)
        assert stored_record(stack.redis_url, close) is None
        for sid in (go_on, cancel):
            assert c.close_session(sid)


def test_a_cancel_within_the_lease_of_a_killed_orchestrator_is_not_lost(
    stack: Stack, doomed: OrchestratorProcess
) -> None:
    """The outside tester's report (issue 46): the owner of a generating kept session is
    SIGKILLed and the session is cancelled on another orchestrator while the dead one's
    lease still runs. Before, the cancel answered OK but was lost: once the lease ran
    out the session read IDLE and could be continued. Now it reads CANCELLED, a
    continuation is refused with FAILED_PRECONDITION, and the stored record ends
    CANCELLED."""
    with Client(doomed.address, timeout_s=60) as c:
        stream = iter(
            c.stream([*PROMPT, 9], max_new_tokens=4000, drafter="none", keep_session=True)
        )
        sid = next(stream).session_id
        assert doomed.proc is not None
        doomed.proc.kill()
        killed = time.monotonic()
    with Client(stack.address, timeout_s=30) as c:
        assert c.cancel(sid)  # the dead orchestrator's lease still runs
        assert time.monotonic() - killed < LEASE_S
        while time.monotonic() - killed < LEASE_S + 1.0:  # refused all along, then too
            with pytest.raises(grpc.RpcError) as info:
                c.generate([3, 4], session_id=sid, max_new_tokens=5, keep_session=True)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            time.sleep(0.2)
        assert "cancelled" in (info.value.details() or "")
        assert c.get_session(sid).state == generate_pb2.SESSION_STATE_CANCELLED
        record = stored_record(stack.redis_url, sid)
        assert record is not None and record.state == generate_pb2.SESSION_STATE_CANCELLED
        assert not c.cancel(sid)  # nothing runs it any more
        assert c.close_session(sid)


@pytest.fixture
def two_targets(redis_url: str) -> Iterator[Stack]:
    s = Stack(redis_url, targets=2)
    try:
        yield s.start()
    finally:
        for t in s.target_procs:
            if t.proc is not None:
                t.proc.send_signal(signal.SIGCONT)
        s.stop()


def test_a_stopped_targets_sessions_move_within_the_stall_time(
    two_targets: Stack, reference: Reference
) -> None:
    """SIGSTOP the target a stream decodes on: the stream pauses for about the stall time
    (5 s by default; before, the 60 s target timeout), then goes on, unchanged, on the
    other target."""
    n = 600
    expected = reference.decode(PROMPT, n)
    with Client(two_targets.address, timeout_s=40) as c:
        stream = iter(c.stream(PROMPT, max_new_tokens=n, drafter="none"))
        deltas = [next(stream)]
        record = stored_record(two_targets.redis_url, deltas[0].session_id)
        assert record is not None and record.target.endpoint
        victim = next(t for t in two_targets.target_procs if t.address == record.target.endpoint)
        survivor = next(t for t in two_targets.target_procs if t is not victim)
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGSTOP)
        largest_gap, last = 0.0, time.monotonic()
        for d in stream:
            now = time.monotonic()
            largest_gap, last = max(largest_gap, now - last), now
            deltas.append(d)
        victim.proc.send_signal(signal.SIGCONT)
    print(f"largest gap while the target was stopped: {largest_gap:.2f} s")
    assert [t for d in deltas for t in d.token_ids] == expected
    assert deltas[-1].finish_reason == "length"
    assert 1.0 < largest_gap < STALL_S + 3.0  # the stall time, plus a replay on a cold target
    deadline = time.monotonic() + 10
    while kv_used(survivor.address, "target")[0]:  # released there at the end
        assert time.monotonic() < deadline
        time.sleep(0.05)
    failovers = two_targets.metric("specserve_orchestrator_target_failovers")
    assert sum(failovers.values()) >= 1
