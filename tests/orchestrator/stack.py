"""A whole stack in child processes for end-to-end tests: target(s), draft, orchestrator, Redis.

Every server runs a tiny random model with one torch thread. :func:`reference`
decodes the same request in this process with the local engine, target-only,
which is what every greedy output must equal.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.ngram import NgramDrafter
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.tiny import tiny_from_spec
from specserve.engine.verifier import TargetVerifier
from specserve.orchestrator.launch import OrchestratorProcess
from specserve.orchestrator.store.redis_settings import RedisSettings
from specserve.orchestrator.store.session_store import SessionStore
from specserve.policy.k_policy import KPolicy
from specserve.serving.launch import ServerProcess, stop_all
from specserve.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.orchestrator.redis_server import free_port

TARGET = "tiny:3"
DRAFT = "tiny:3:noise=0.3"
SERVER_ARGS = ["--threads", "1", "--kv-budget", "8MiB"]
# The stacks run the orchestrator's default scheduling policy: the lossless tests exercise
# what a deployment runs. One torch thread per process: several share the test machine.
ENV = {"OMP_NUM_THREADS": "1"}


@dataclass
class Stack:
    """Replicas and an orchestrator; :meth:`start` launches them all, overlapping start-ups.

    With ``replicas`` (another started stack) only the orchestrator is this stack's own:
    it runs over that stack's target(s) and draft, and :meth:`stop` stops it alone. For
    tests that need an orchestrator of their own (its flags, its metrics, a planner that
    has seen no other test's rounds) but nothing of the replicas': each replica process
    saved is a torch import and a model build (about a second and a half on two cores).
    """

    redis_url: str
    targets: int = 1
    orchestrator_args: Sequence[str] = ()
    target_args: Sequence[Sequence[str]] = ()  # extra flags of target i
    draft_model: str = DRAFT
    target_model: str = TARGET
    draft_args: Sequence[str] = ()  # extra flags of the draft
    target_procs: list[ServerProcess] = field(default_factory=list)
    draft: ServerProcess | None = None
    orchestrator: OrchestratorProcess | None = None
    metrics_port: int = 0
    replicas: Stack | None = None  # a started stack whose target(s) and draft this one uses

    def start(self) -> Stack:
        if self.replicas is not None:
            assert self.replicas.draft is not None, "the replicas' stack is not started"
            assert not (self.target_args or self.draft_args), "those are the replicas' flags"
            self.target_procs, self.draft = self.replicas.target_procs, self.replicas.draft
        else:
            extra = [*self.target_args, *[()] * self.targets][: self.targets]
            self.target_procs = [
                ServerProcess(
                    "target", ["--model", self.target_model, *SERVER_ARGS, *more], env=ENV
                )
                for more in extra
            ]
            self.draft = ServerProcess(
                "draft", ["--model", self.draft_model, *SERVER_ARGS, *self.draft_args], env=ENV
            )
            for s in [*self.target_procs, self.draft]:
                s.start()
        self.metrics_port = free_port()
        self.orchestrator = OrchestratorProcess(
            [
                "--target",
                ",".join(t.address for t in self.target_procs),
                "--draft",
                self.draft.address,
                "--redis-url",
                self.redis_url,
                "--metrics-port",
                str(self.metrics_port),
                *self.orchestrator_args,
            ],
            env=ENV,
        )
        self.orchestrator.start()
        for s in [*self.target_procs, self.draft, self.orchestrator]:
            s.wait_serving()
        return self

    def stop(self) -> None:
        """Stop this stack's own processes, all draining at once (as ``specserve up``
        stops its children): one process's shutdown overlaps the others'."""
        if self.replicas is not None:
            stop_all([self.orchestrator])
        else:
            stop_all([self.orchestrator, self.draft, *self.target_procs])

    @property
    def address(self) -> str:
        assert self.orchestrator is not None
        return self.orchestrator.address

    def metric(self, name: str) -> dict[str, float]:
        """Samples of one orchestrator metric, keyed by their label text."""
        return scrape(self.metrics_port, name)


def scrape(port: int, name: str) -> dict[str, float]:
    """Samples of one Prometheus metric served on ``port``, keyed by their label text."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        body = r.read().decode()
    out = {}
    for m in re.finditer(rf"^{name}(?:_total)?(\{{[^}}]*\}})? (\S+)$", body, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def kv_used(address: str, role: str) -> tuple[int, int]:
    """(sessions, kv_bytes_used) a replica reports."""
    stub_class = {
        "draft": draft_pb2_grpc.DraftServiceStub,
        "target": target_pb2_grpc.TargetServiceStub,
    }[role]
    with grpc.insecure_channel(address) as channel:
        load = stub_class(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5)
    return load.sessions, load.kv_bytes_used


def redis_keys(url: str) -> list[str]:
    async def go() -> list[str]:
        store = SessionStore(RedisSettings.from_url(url).client())
        try:
            return await store.keys()
        finally:
            await store.close()

    return asyncio.run(go())


def stored_record(url: str, session_id: str):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        store = SessionStore(RedisSettings.from_url(url).client())
        try:
            return await store.get(session_id)
        finally:
            await store.close()

    return asyncio.run(go())


class Reference:
    """The local engine on the same tiny models, one fresh session per call."""

    def __init__(self) -> None:
        budget = 8 << 20
        self.engine = SpeculativeEngine(
            TargetVerifier(tiny_from_spec(TARGET), budget),
            {"model": ModelDrafter(tiny_from_spec(DRAFT), budget), "ngram": NgramDrafter()},
        )
        self.count = 0

    def decode(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        drafter: str = "none",
        k: int | None = 0,
        params: SamplingParams | None = None,
        round_index: int = 0,
    ) -> list[int]:
        self.count += 1
        state = DecodeState(
            f"ref-{self.count}",
            list(prompt),
            params or SamplingParams(),
            StopCriteria(max_new_tokens),
            KPolicy(k),
            drafter=drafter,
            round_index=round_index,
        )
        self.engine.run([state])
        return state.completion
