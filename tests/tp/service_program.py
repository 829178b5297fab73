"""Greedy decoding through target and draft server processes, for the TP service tests.

Also the Ray scenario's main: ``python -m tests.tp.service_program OUT`` from the
repository root (the test runs it in a fresh network namespace with only loopback
when it can). It starts a local Ray cluster on 127.0.0.1, a draft server and a
``--tp 2 --tp-launcher ray --ray-address <that cluster>`` target server, decodes,
stops the target with SIGTERM and writes OUT/ray.pkl: the result, the target's
exit status and log, or ``{"skip": reason}`` when Ray cannot start here.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import sys
from pathlib import Path
from typing import Any

import grpc

from bench.round_client import RoundClient
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.sampling import SamplingParams
from specserve.policy.k_policy import KPolicy
from specserve.serving.launch import ServerProcess
from specserve.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

SEED = 7
NEW_TOKENS = 16
K = 4
COMMON = ["--threads", "1", "--kv-budget", "8MiB", "--batch-window-ms", "0"]
LOOPBACK = "127.0.0.1"
# gloo binds the loopback interface; one OpenMP thread per rank on a small machine.
GLOO_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
START_TIMEOUT_S = 120.0


def specs(model_type: str) -> tuple[str, str]:
    """(target, draft) tiny specs: the draft is a noisy copy of the target."""
    base = f"tiny:{SEED}" if model_type == "qwen2" else f"tiny:{SEED}:{model_type}"
    return base, f"{base}:noise=0.3"


def _states(name: str, drafter: str, k: int) -> list[DecodeState]:
    rng = random.Random(SEED)
    prompts = [[rng.randrange(256) for _ in range(4 + 3 * i)] * 3 for i in range(3)]
    return [
        DecodeState(
            f"{name}{i}", p, SamplingParams(), StopCriteria(NEW_TOKENS), KPolicy(k), drafter=drafter
        )
        for i, p in enumerate(prompts)
    ]


def decode(target: str, draft: str) -> dict[str, Any]:
    """Speculative and target-only greedy decoding of the same prompts, in one batch."""

    async def go() -> dict[str, Any]:
        async with (
            grpc.aio.insecure_channel(target) as t_channel,
            grpc.aio.insecure_channel(draft) as d_channel,
        ):
            target_stub = target_pb2_grpc.TargetServiceStub(t_channel)
            client = RoundClient(target_stub, draft_pb2_grpc.DraftServiceStub(d_channel))
            spec, plain = _states("spec", "model", K), _states("plain", "none", 0)
            await client.run([*spec, *plain])
            load = await target_stub.GetLoad(common_pb2.GetLoadRequest())
        return {
            "spec": [s.completion for s in spec],
            "plain": [s.completion for s in plain],
            "stats": [(s.stats.rounds, s.stats.drafted, s.stats.accepted) for s in spec],
            "drafted": sum(s.stats.drafted for s in spec),
            "accepted": sum(s.stats.accepted for s in spec),
            "tp_size": load.tp_size,
            "sessions_after": load.sessions,  # run() released every session
        }

    return asyncio.run(go())


def start_all(*servers: ServerProcess) -> None:
    """Spawn every server, then wait for all (their start-ups overlap)."""
    for s in servers:
        s.start(START_TIMEOUT_S)
    for s in servers:
        s.wait_serving(START_TIMEOUT_S)


def main(out: Path) -> None:
    import ray

    os.environ.update(GLOO_ENV)  # the raylet, and so the rank actors it starts, inherit it
    try:
        info = ray.init(
            address="local",
            num_cpus=2,  # one bundle per rank
            include_dashboard=False,
            _node_ip_address=LOOPBACK,
            object_store_memory=100 << 20,
            log_to_driver=False,
        )
    except Exception as e:  # no shared memory, no sockets...: not the code under test
        (out / "ray.pkl").write_bytes(pickle.dumps({"skip": f"Ray cannot start here: {e}"}))
        return
    address = info.address_info["gcs_address"]
    target_spec, draft_spec = specs("qwen2")
    tp = ["--tp", "2", "--tp-launcher", "ray", "--ray-address", address, "--tp-backend", "gloo"]
    target = ServerProcess("target", ["--model", target_spec, *tp, *COMMON])
    draft = ServerProcess("draft", ["--model", draft_spec, *COMMON])
    report: dict[str, Any] = {}
    try:
        start_all(target, draft)
        report["result"] = decode(target.address, draft.address)
        report["exit"] = target.stop(timeout_s=60)  # SIGTERM: drain, close the group
        report["log"] = target.output()
    finally:
        target.stop()
        draft.stop()
        ray.shutdown()
    (out / "ray.pkl").write_bytes(pickle.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
