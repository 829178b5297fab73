"""The DraftService servicer: pb -> engine inputs -> model thread -> pb, nothing more.

Validation lives in :mod:`specserve.draft_service.convert`, the work in
:class:`~specserve.draft_service.backend.DraftBackend` on the model thread, and the
status codes in :class:`~specserve.serving.errors.ErrorInterceptor`.
"""

from __future__ import annotations

import grpc.aio
from opentelemetry import trace

from specserve.draft_service.backend import DraftBackend, Proposed
from specserve.draft_service.metrics import DraftCounts
from specserve.engine.drafter import DraftCall
from specserve.serving.call_stream import StreamMethod
from specserve.serving.errors import check_strict
from specserve.serving.server import RunningServer
from specserve.telemetry import attributes as attr
from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specserve.wire import common_wire, draft_wire


# Batched ops for the model executor: (backend, one payload per coalesced call) -> results.
# Calling through the instance keeps a subclassed backend's overrides.
def _run_propose(backend: DraftBackend, calls: list[list[DraftCall]]) -> list[Proposed]:
    return backend.propose(calls)


def _run_release(backend: DraftBackend, calls: list[list[str]]) -> list[int]:
    return backend.release(calls)


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Serves Propose / Release / GetLoad from a :class:`DraftBackend`."""

    def __init__(self, running: RunningServer[DraftBackend]) -> None:
        self.running = running
        self.executor = running.executor
        self.counts = DraftCounts()
        # Propose on the data-plane socket (specserve.serving.data_socket)
        self.propose_stream = StreamMethod("/specserve.v1.DraftService/Propose", self.propose)

    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        with self.running.holding(request):
            return await self.propose(request)

    async def propose(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        """One Propose call, unary or on the data-plane socket; errors raise (mapped by the
        caller)."""
        backend = self.executor.backend
        calls = draft_wire.draft_calls(request, backend.vocab, backend.limit)
        for c in calls:
            backend.check_drafter(c.drafter, c.input.session_id)
        done = await self.executor.submit(
            _run_propose,
            calls,
            key="propose",
            sessions=[c.input.session_id for c in calls],
            kind="propose",
        )
        self.counts.record(calls, done.value.outcomes)
        span = trace.get_current_span()  # the call's server span
        if span.is_recording():
            span.set_attributes(
                {
                    attr.SPEC_K: sum(c.input.k for c in calls),
                    attr.SPEC_DRAFTED: sum(
                        len(o.proposal.tokens) for o in done.value.outcomes if o.proposal
                    ),
                    attr.BATCH_SIZE: done.batch_sessions,
                    attr.BATCH_CALLS: done.batch_jobs,
                    attr.QUEUE_WAIT: done.queue_s,
                    attr.COMPUTE: done.compute_ns / 1e9,
                }
            )
        if request.strict:
            stale = [
                c.input.session_id
                for c, o in zip(calls, done.value.outcomes, strict=True)
                if o.stale
            ]
            check_strict(stale, done.value.unknown, "draft")
        response = draft_wire.propose_response(done.value.outcomes, calls)
        response.compute_ns = done.compute_ns
        response.batch_size = done.batch_sessions
        response.replica_id = self.running.replica_id
        return response

    async def Release(
        self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ReleaseResponse:
        self.executor.backend  # noqa: B018 -- refuses with UNAVAILABLE unless serving
        ids = list(request.session_ids)
        done = await self.executor.submit(_run_release, ids, sessions=ids)
        return common_pb2.ReleaseResponse(released=done.value)

    async def GetLoad(
        self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoadReport:
        backend = self.executor.backend
        load = backend.load
        return common_wire.load_report(
            replica_id=self.running.replica_id,
            role="draft",
            model=backend.model_name,
            dtype=backend.dtype,
            sessions=load.sessions,
            kv_bytes_used=load.kv_bytes_used,
            kv_bytes_free=load.kv_bytes_free,
            queue_depth=self.executor.queue_depth(),
            progress_steps=self.executor.progress.steps,
            model_cpu_ns=self.executor.progress.cpu_ns(),
            busy=self.executor.busy(),
            limit=backend.limit,
            data_port=self.running.data_port,
        )
