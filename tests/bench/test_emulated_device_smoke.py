"""bench.emulated_device starts both servers on tiny models, and their forwards take the
device time asked for (what ``bench.concurrency --emulate-devices`` relies on).

Nothing else runs this module's ``main``, so a change to how a server process is
started shows up here rather than as a benchmark that no longer starts."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from specserve.serving.launch import ServerProcess
from specserve.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

FORWARD_MS = 40.0
FLAGS = ["--threads", "1", "--kv-budget", "8MiB", "--dtype", "float32"]
PROMPT = [(i * 29 + 3) % 256 for i in range(12)]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(target, draft), each ``python -m bench.emulated_device ROLE --forward-ms 40``."""
    device = ["--forward-ms", str(FORWARD_MS)]
    target = ServerProcess(
        "target", ["target", *device, "--model", "tiny:3", *FLAGS], module="bench.emulated_device"
    )
    draft = ServerProcess(
        "draft",
        ["draft", *device, "--model", "tiny:3:noise=0.3", *FLAGS],
        module="bench.emulated_device",
    )
    try:
        for server in (target, draft):
            server.start()
        for server in (target, draft):
            server.wait_serving()
        yield target, draft
    finally:
        target.stop()
        draft.stop()


def test_a_target_prefill_takes_at_least_one_forwards_device_time(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    with grpc.insecure_channel(servers[0].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        session = target_pb2.PrefillSession(session_id="emulated-t", tokens=PROMPT)
        response = stub.Prefill(target_pb2.PrefillRequest(sessions=[session]), timeout=30)
    assert len(response.results) == 1
    assert response.compute_ns >= FORWARD_MS * 1e6


def test_a_draft_proposal_of_three_tokens_takes_three_forwards_device_time(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    with grpc.insecure_channel(servers[1].address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        session = draft_pb2.DraftSession(session_id="emulated-d", new_tokens=PROMPT, k=3)
        response = stub.Propose(draft_pb2.ProposeRequest(sessions=[session]), timeout=30)
    assert len(response.results[0].tokens) == 3
    # The prompt's prefill yields the first draft; two more steps give the other two.
    assert response.compute_ns >= 3 * FORWARD_MS * 1e6
