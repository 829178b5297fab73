"""The target service split over two ranks (gloo on CPU, loopback only), end to end.

Real gRPC: a draft server in its own process, target servers in theirs, and the
:class:`~bench.round_client.RoundClient` loop. A TP=2 target launched
by ``torchrun`` decodes exactly as the TP=1 service for a tiny Qwen2 and a tiny
Llama; a Ray-launched TP=2 target decodes exactly as the torchrun one; and a
killed worker rank ends rank 0 (NOT_SERVING, exit 1) within the collective timeout.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from specserve.serving.launch import ServerProcess
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.tp.isolation import netns_prefix
from tests.tp.ranks import LOOPBACK, free_port, torchrun_env
from tests.tp.service_program import COMMON, GLOO_ENV, decode, specs, start_all

pytestmark = pytest.mark.tp

REPO = Path(__file__).resolve().parents[2]
MODEL_TYPES = ("qwen2", "llama")


def torchrun_target(spec: str) -> ServerProcess:
    """``torchrun --nproc-per-node 2 -m specserve.target_service --tp 2 ...`` on loopback."""
    torchrun = ["--nproc-per-node", "2", "--master-addr", LOOPBACK]
    torchrun += ["--master-port", str(free_port())]
    server = ["-m", "specserve.target_service", "--model", spec, "--tp", "2"]
    server += ["--tp-backend", "gloo", *COMMON]
    return ServerProcess(
        "target", [*torchrun, *server], module="torch.distributed.run", env=GLOO_ENV
    )


@pytest.fixture(scope="module")
def decoded() -> Iterator[dict[str, dict[str, Any]]]:
    """Per model type: decoding through the TP=1 and the torchrun TP=2 target, and the
    TP=2 group's log after a graceful stop. Every server starts at once."""
    stacks = {}
    for model_type in MODEL_TYPES:
        target, draft = specs(model_type)
        stacks[model_type] = (
            ServerProcess("target", ["--model", target, *COMMON]),
            torchrun_target(target),
            ServerProcess("draft", ["--model", draft, *COMMON]),
        )
    everyone = [s for stack in stacks.values() for s in stack]
    out: dict[str, dict[str, Any]] = {}
    try:
        start_all(*everyone)
        for model_type, (tp1, tp2, draft) in stacks.items():
            out[model_type] = {
                "tp1": decode(tp1.address, draft.address),
                "tp2": decode(tp2.address, draft.address),
            }
            tp2.stop(timeout_s=30)  # SIGTERM to torchrun, which passes it to both ranks
            out[model_type]["tp2_log"] = tp2.output()
        yield out
    finally:
        for s in everyone:
            s.stop()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_torchrun_tp2_service_decodes_as_tp1(
    decoded: dict[str, dict[str, Any]], model_type: str
) -> None:
    tp1, tp2 = decoded[model_type]["tp1"], decoded[model_type]["tp2"]
    assert tp2["spec"] == tp1["spec"] == tp1["plain"] == tp2["plain"]
    assert tp2["stats"] == tp1["stats"]  # same rounds, drafts and acceptances per session
    assert tp2["drafted"] > 0 and tp2["accepted"] > 0
    assert (tp1["tp_size"], tp2["tp_size"]) == (1, 2)
    assert tp2["sessions_after"] == 0
    log = decoded[model_type]["tp2_log"]
    assert "tensor-parallel rank 1 of 2" in log and "worker, no gRPC" in log
    assert "tensor-parallel rank 0 of 2 (torchrun" in log
    # SIGTERM: rank 0 drained and closed the group; the worker then left cleanly.
    assert "closing the tensor-parallel group (2 ranks)" in log
    assert "tensor-parallel rank 1: rank 0 closed the group; exiting" in log


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="Ray is not installed: pip install -e '.[tp]'"
)
def test_ray_tp2_service_decodes_as_torchrun(
    tmp_path: Path, decoded: dict[str, dict[str, Any]]
) -> None:
    command = [*netns_prefix(), sys.executable, "-m", "tests.tp.service_program", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = pickle.loads((tmp_path / "ray.pkl").read_bytes())
    if "skip" in report:
        pytest.skip(report["skip"])
    result = report["result"]
    torchrun = decoded["qwen2"]["tp2"]
    assert result == torchrun
    assert result["accepted"] > 0 and result["tp_size"] == 2
    assert report["exit"] == 0, report["log"][-4000:]  # SIGTERM: the group closed cleanly
    assert "tensor-parallel rank 0 of 2 (ray" in report["log"]
    assert "closing the tensor-parallel group (2 ranks)" in report["log"]


def test_killed_worker_rank_ends_rank0_within_the_timeout(tmp_path: Path) -> None:
    """Ranks started as torchrun starts them (no torchrun agent, which would tear
    rank 0 down itself): rank 0 must notice the dead rank and exit 1 on its own."""
    timeout_s = 3.0
    spec, _ = specs("qwen2")
    args = ["--model", spec, "--tp", "2", "--tp-backend", "gloo", "--tp-timeout-s", str(timeout_s)]
    args += COMMON
    port = free_port()
    log = (tmp_path / "rank1.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "specserve.target_service", *args],
        env={**os.environ, **GLOO_ENV, **torchrun_env(1, 2, port)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    rank0 = ServerProcess("target", args, env={**GLOO_ENV, **torchrun_env(0, 2, port)})
    try:
        rank0.start(120).wait_serving(120)
        with grpc.insecure_channel(rank0.address) as channel:  # the group works
            session = target_pb2.PrefillSession(session_id="a", tokens=[5, 6, 7])
            stub = target_pb2_grpc.TargetServiceStub(channel)
            stub.Prefill(target_pb2.PrefillRequest(sessions=[session]), timeout=30)
            # KV snapshots are refused on a TP target, and GetLoad says so up front.
            assert stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10).kv_fingerprint == b""
            export = target_pb2.ExportKvRequest(session_id="a", chunk_tokens=1, tokens=[5])
            with pytest.raises(grpc.RpcError) as refused:
                stub.ExportKv(export, timeout=30)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "tensor-parallel" in (refused.value.details() or "")
        worker.send_signal(signal.SIGKILL)
        started = time.monotonic()
        assert rank0.proc is not None
        code = rank0.proc.wait(timeout=timeout_s * 4)
        elapsed = time.monotonic() - started
        output = rank0.output()
        assert code == 1, output[-4000:]
        assert elapsed < timeout_s + 2, output[-4000:]
        assert "the replica is NOT_SERVING" in output and "tensor-parallel group" in output
    finally:
        rank0.stop()
        if worker.poll() is None:
            worker.kill()
        worker.wait()
