"""A Ray-launched TP=2 group decodes the greedy case; run by test_tp_ray in a subprocess.

``python -m tests.tp.ray_program OUT`` from the repository root. The test runs it
inside a fresh network namespace (``unshare -n``) when it can, so that Ray's
servers, which listen on every interface, see only loopback. Writes OUT/ray.pkl:
the decoding result and what happened when a worker actor was killed, or
``{"skip": reason}`` when Ray cannot start.
"""

from __future__ import annotations

import pickle
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from specserve.engine.errors import InvalidArgument
from specserve.engine.tp import TPGroupError
from specserve.target_service.tp_config import TPSettings
from specserve.target_service.tp_worker import start_tp_verifier
from tests.tp import programs

REPO = Path(__file__).resolve().parents[2]


def main(out: Path) -> None:
    import ray

    try:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            object_store_memory=100 << 20,
            log_to_driver=False,
            runtime_env={
                "env_vars": {
                    "GLOO_SOCKET_IFNAME": "lo",
                    "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": str(REPO),  # the actors unpickle programs.load_target
                }
            },
        )
    except Exception as e:  # no shared memory, no sockets...: not the code under test
        (out / "ray.pkl").write_bytes(pickle.dumps({"skip": f"Ray cannot start here: {e}"}))
        return
    seed, model_type, k = programs.GREEDY_CASE.values()
    settings = TPSettings(
        world_size=2, launcher="ray", backend="gloo", timeout_s=20.0, num_threads=1
    )
    report: dict[str, Any] = {}
    started = time.monotonic()
    verifier: Any = start_tp_verifier(
        partial(programs.load_target, seed, model_type), programs.BUDGET, settings
    )
    report["start_s"] = time.monotonic() - started
    try:
        report["healthy_before"] = verifier.healthy()
        bad_input = ""
        try:  # the engine's own error crosses Ray as itself
            programs.verify_once(verifier, "bad", tokens=[5, 1 << 20])
        except InvalidArgument as e:
            bad_input = str(e)
        report["result"] = programs.decode(verifier, seed, model_type, k)
        report["result"]["bad_input"] = bad_input
        ray.kill(verifier.actors[1])  # a worker dies: rank 0 notices at its next step
        try:
            programs.decode(verifier, seed, model_type, k)
            report["error"] = None
        except TPGroupError as e:
            report["error"] = str(e)
        report["healthy_after_kill"] = verifier.healthy()
    finally:
        verifier.close()
    report["healthy_after_close"] = verifier.healthy()
    (out / "ray.pkl").write_bytes(pickle.dumps(report))
    ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
