"""The target server's tensor-parallel side: rank 0's load and watch, a worker rank's main.

* Rank 0 serves gRPC: under torchrun the process of ``RANK`` 0, with Ray the one
  launched process (it drives the rank actors). Its model thread loads through
  :meth:`GroupWatch.load`, which joins (torchrun) or starts (Ray) the rank group
  and wraps the group's verifier in a :class:`TargetBackend`.
* A torchrun process of rank > 0 runs :func:`serve_worker_rank` instead of a
  server: it binds nothing, mirrors rank 0's forwards, and exits 0 when rank 0
  closes the group or 1 when rank 0 goes away.
* :meth:`GroupWatch.run` polls the group's health on rank 0's event loop. Once a
  rank died or stopped answering within ``--tp-timeout-s`` the group is unusable
  for good, so the replica turns NOT_SERVING and the process exits 1: its
  supervisor (torchrun, Kubernetes) restarts the whole group.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from functools import partial
from typing import NoReturn

from specserve.serving.executor import State
from specserve.serving.models import load_weights, tokenizer_vocab
from specserve.serving.server import RunningServer, identity_of, setup_process
from specserve.target_service.backend import TargetBackend
from specserve.target_service.config import TargetServerConfig
from specserve.target_service.tp_config import torchrun_rank
from specserve.target_service.tp_worker import ModelFactory, start_tp_verifier

log = logging.getLogger(__name__)


def model_factory(config: TargetServerConfig) -> ModelFactory:
    """What every rank builds before keeping its shard (picklable, for the Ray actors)."""
    return partial(load_weights, config.model, config.dtype, config.fail_after_forwards)


class GroupWatch:
    """Rank 0's hold on its rank group: loads it, then ends the process once it fails."""

    def __init__(self, config: TargetServerConfig) -> None:
        assert config.tp.world_size > 1
        self.config = config
        self.backend: TargetBackend | None = None  # set on the model thread once loaded

    def load(self) -> TargetBackend:
        """Join or start the rank group and serve its verifier (runs on the model thread)."""
        cfg = self.config
        vocab = tokenizer_vocab(cfg.model)  # before the ranks load (a GGUF converts here)
        verifier = start_tp_verifier(
            model_factory(cfg), cfg.kv_budget_bytes, cfg.tp, vocab_limit=vocab
        )
        assert verifier is not None, "rank 0 drives the group; workers never load a server"
        log.info(
            "tensor-parallel rank 0 of %d (%s, pid %d): serving gRPC, driving the other ranks",
            cfg.tp.world_size,
            cfg.tp.launcher,
            os.getpid(),
        )
        self.backend = TargetBackend(
            verifier, model_name=cfg.model, dtype=cfg.dtype, tp_size=cfg.tp.world_size
        )
        return self.backend

    @property
    def interval_s(self) -> float:
        """How often health is polled: well inside the collective timeout."""
        return min(1.0, self.config.tp.timeout_s / 6)

    async def run(self, running: RunningServer[TargetBackend]) -> None:
        """Until shutdown (which cancels this): abort the process once the group fails."""
        while self.backend is None:
            if running.executor.state is State.FAILED:
                return  # the load failed: the server exits on that already
            await asyncio.sleep(self.interval_s)
        backend = self.backend
        while await asyncio.to_thread(backend.healthy):  # may be one Ray call
            await asyncio.sleep(self.interval_s)
        await running.set_serving(False)
        running.abort(
            f"the tensor-parallel group of {self.config.tp.world_size} ranks failed "
            "(a rank died or stopped answering); the replica is NOT_SERVING"
        )


def serve_worker_rank(config: TargetServerConfig) -> int:
    """A torchrun rank > 0: mirror rank 0's forwards until it closes the group.

    SIGTERM and SIGINT are ignored: torchrun and Kubernetes signal every rank at
    once, and a worker that left first would fail rank 0's in-flight forwards.
    Rank 0 drains, then closes the group, and this rank exits 0; if rank 0 dies
    instead, the next collective fails (within the TP timeout) and it exits 1.
    """
    setup_process(config.server, identity_of(config.server, "target", config.model))
    rank, size = torchrun_rank(), config.tp.world_size
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    log.info("tensor-parallel rank %d of %d (pid %d): worker, no gRPC", rank, size, os.getpid())
    try:
        start_tp_verifier(model_factory(config), config.kv_budget_bytes, config.tp)
    except Exception as e:
        log.error("tensor-parallel rank %d: the group failed (%s); exiting", rank, e)
        exit_now(1)
    log.info("tensor-parallel rank %d: rank 0 closed the group; exiting", rank)
    return 0


def exit_now(code: int) -> NoReturn:
    """Exit without interpreter teardown, which a broken process group can hang."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
