"""bench.emulated_device starts both servers on tiny models, and their forwards (and the
local loop's) take the device time asked for (what ``bench.emulated_gpu`` and
``bench.concurrency --emulate-devices`` rely on).

Nothing else runs this module's ``main``, so a change to how a server process is
started shows up here rather than as a benchmark that no longer starts."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch

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


class _FakeClock:
    """``emulated_device.time`` in a test: every clock read is ``cpu_s`` later than the
    last, so a forward's own CPU time reads as ``cpu_s``; sleeps are recorded, not slept."""

    def __init__(self, cpu_s: float) -> None:
        self.now, self.cpu_s, self.waits = 0.0, cpu_s, []  # type: ignore[var-annotated]

    def perf_counter(self) -> float:
        self.now += self.cpu_s
        return self.now

    def sleep(self, seconds: float) -> None:
        self.waits.append(round(seconds, 9))


def test_the_local_loop_with_emulated_devices_waits_for_every_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``bench.emulated_gpu`` compares the stack with: every target round and every
    drafted token of the local loop lasts its device time, its own CPU time included
    (fixed k = 2, 6 tokens; each forward's CPU time reads as 0.5 ms)."""
    clock = _FakeClock(cpu_s=0.0005)
    monkeypatch.setattr(emulated_device, "time", clock)
    runner = LocalRunner(LocalConfig(target="tiny:3", draft="tiny:3:noise=0.3", threads=1))
    draft_ms, target_ms = 2.0, 12.0
    emulated_device.emulate_local(runner, draft_ms, target_ms)
    done = runner.generate(PROMPT, SamplingParams(), max_new_tokens=6, k=2, ignore_eos=True)
    assert done.stats.drafted > 0 and done.stats.rounds > 0
    # What is left of a forward's device time after its 0.5 ms of CPU:
    assert clock.waits.count(0.0115) >= done.stats.rounds  # one target forward a round at least
    assert clock.waits.count(0.0015) >= done.stats.drafted  # one draft forward a drafted token
    assert set(clock.waits) == {0.0115, 0.0015}


def test_a_forward_whose_cpu_time_passes_the_device_time_does_not_sleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _FakeClock(cpu_s=0.003)  # 3 ms of CPU against a 2 ms device time
    monkeypatch.setattr(emulated_device, "time", clock)
    model = torch.nn.Linear(4, 4)
    emulated_device.add_device_time(model, 2.0)
    model(torch.zeros(1, 4))
    assert clock.waits == []
    emulated_device.add_device_time(torch_model := torch.nn.Linear(4, 4), 5.0)
    torch_model(torch.zeros(1, 4))
    assert clock.waits == [0.002]


def test_a_local_loop_without_a_draft_model_is_refused() -> None:
    runner = LocalRunner(LocalConfig(target="tiny:3", threads=1))
    with pytest.raises(ValueError, match="no draft model"):
        emulated_device.emulate_local(runner, 1.0, 6.0)
