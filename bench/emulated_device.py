"""Draft and target servers whose model forwards take a fixed device time, CPU idle meanwhile.

``python -m bench.emulated_device draft|target --forward-ms MS [the server's own flags]``
runs the real server (real model, real caches, real tokens) and makes every
model forward last ``MS``, as a replica on its own accelerator does: the host
CPU waits while the device computes. On a machine with few shared cores the
draft and the target then no longer compete for the CPU, so what a scheduling
choice (draft/verify pipelining) does on separate devices can be
measured here: ``bench.emulated_gpu`` and ``bench.concurrency --emulate-devices
DRAFT_MS,TARGET_MS``. :func:`emulate_local` does the same to the local loop.

A forward costs ``MS`` whatever its token count, like a memory-bound forward on
a GPU at small batches: the tiny model's own CPU time is the start of that time
(the device computing), and the forward sleeps out the rest. Only a forward whose
CPU time alone passes ``MS`` (none at the settings the benchmarks use) lasts longer.
Everything around the forward (planning its batch, sampling, the servers' and the
orchestrator's Python) is host time, as on a GPU replica.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from torch import nn

from specserve.draft_service import config as draft_config
from specserve.draft_service import server as draft_server
from specserve.engine.drafter import DrafterKind
from specserve.engine.model_drafter import ModelDrafter
from specserve.local import LocalRunner
from specserve.serving.server import identity_of, run_process
from specserve.target_service import config as target_config
from specserve.target_service import server as target_server


def add_device_time(model: nn.Module, forward_ms: float) -> None:
    """Every forward of ``model`` lasts ``forward_ms`` (its own CPU time included: the
    forward sleeps what is left of it), or its CPU time where that is longer."""
    seconds = forward_ms / 1e3
    started: list[float] = []  # forwards of one model do not nest

    def pre_hook(module: nn.Module, args: Any) -> None:
        started.append(time.perf_counter())

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        left = seconds - (time.perf_counter() - started.pop())
        if left > 0:
            time.sleep(left)

    model.register_forward_pre_hook(pre_hook)
    model.register_forward_hook(hook)


def emulate_local(runner: LocalRunner, draft_ms: float, target_ms: float) -> None:
    """The local loop's target and draft model forwards take ``target_ms`` / ``draft_ms``
    of device time, as the emulated servers' do."""
    add_device_time(runner.target, target_ms)
    drafter = runner.engine.drafters.get(DrafterKind.MODEL)
    if not isinstance(drafter, ModelDrafter):
        raise ValueError("the local loop has no draft model to give device time to")
    add_device_time(drafter.model, draft_ms)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    role = argv.pop(0) if argv else ""
    if role not in ("draft", "target"):
        print("usage: python -m bench.emulated_device draft|target --forward-ms MS ...")
        return 2
    parser = argparse.ArgumentParser(prog=f"python -m bench.emulated_device {role}")
    parser.add_argument("--forward-ms", type=float, required=True, help="device time per forward")
    if role == "draft":
        draft_config.add_arguments(parser)
        args = parser.parse_args(argv)
        dconfig = draft_config.from_args(args)

        def load_draft() -> Any:
            backend = draft_server.load_backend(dconfig)
            assert backend.model is not None, "the draft server needs a model here"
            add_device_time(backend.model.model, args.forward_ms)
            return backend

        identity = identity_of(dconfig.server, "draft", dconfig.model or "ngram")
        return run_process(
            lambda: draft_server.start(dconfig, load=load_draft), dconfig.server, identity
        )
    target_config.add_arguments(parser)
    args = parser.parse_args(argv)
    tconfig = target_config.from_args(args)

    def load_target() -> Any:
        backend = target_server.load_backend(tconfig)
        add_device_time(backend.verifier.model, args.forward_ms)
        return backend

    identity = identity_of(tconfig.server, "target", tconfig.model)
    return run_process(
        lambda: target_server.start(tconfig, load=load_target), tconfig.server, identity
    )


if __name__ == "__main__":
    sys.exit(main())
