"""bench.emulated_device starts both servers on tiny models, and their forwards (and the
local loop's) take the device time asked for (what ``bench.emulated_gpu`` and
``bench.concurrency --emulate-devices`` rely on).

Nothing else runs this module's ``main``, so a change to how a server process is
started shows up here rather than as a benchmark that no longer starts."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from bench import emulated_device
from specserve.engine.sampling import SamplingParams
from specserve.local import LocalConfig, LocalRunner
from specserve.serving.launch import ServerProcess
from specserve.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

FORWARD_MS = 40.0
FLAGS = ["--threads", "1", "--kv-budget", "8MiB", "--dtype", "float32"]
START_TIMEOUT_S = 300.0
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
        for server in (target, draft):  # a loaded machine can take minutes to import torch
            server.start(timeout_s=START_TIMEOUT_S)
        for server in (target, draft):
            server.wait_serving(START_TIMEOUT_S)
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


def test_the_local_loop_with_emulated_devices_waits_for_every_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``bench.emulated_gpu`` compares the stack with: every target round and every
    drafted token of the local loop waits its device time (fixed k = 2, 6 tokens; the
    waits are recorded, not slept)."""
    waits: list[float] = []
    monkeypatch.setattr(emulated_device.time, "sleep", waits.append)
    runner = LocalRunner(LocalConfig(target="tiny:3", draft="tiny:3:noise=0.3", threads=1))
    draft_ms, target_ms = 2.0, 12.0
    emulated_device.emulate_local(runner, draft_ms, target_ms)
    done = runner.generate(PROMPT, SamplingParams(), max_new_tokens=6, k=2, ignore_eos=True)
    assert done.stats.drafted > 0 and done.stats.rounds > 0
    assert waits.count(target_ms / 1e3) >= done.stats.rounds  # one forward a round at least
    assert waits.count(draft_ms / 1e3) >= done.stats.drafted  # one forward a drafted token


def test_a_local_loop_without_a_draft_model_is_refused() -> None:
    runner = LocalRunner(LocalConfig(target="tiny:3", threads=1))
    with pytest.raises(ValueError, match="no draft model"):
        emulated_device.emulate_local(runner, 1.0, 6.0)
