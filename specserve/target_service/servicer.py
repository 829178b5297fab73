"""The TargetService servicer: pb -> engine inputs -> model thread -> pb, nothing more.

Prefill and Verify share the coalescing key ``"verify"``: prompts and drafts that
arrive together run in the same forward. ExportKv and ImportKv run alone on the
model thread, in order with the other calls about the same session. Validation
lives in :mod:`specserve.target_service.convert`, the work in
:class:`~specserve.target_service.backend.TargetBackend`, and the status codes in
:class:`~specserve.serving.errors.ErrorInterceptor`.
"""

from __future__ import annotations

import grpc.aio
from opentelemetry import trace

from specserve.engine.kv_transfer import ExportInput, ImportInput, KvChunk
from specserve.engine.verifier import VerifyInput
from specserve.serving.call_stream import StreamMethod
from specserve.serving.errors import check_strict
from specserve.serving.server import RunningServer
from specserve.target_service.backend import TargetBackend, Verified
from specserve.target_service.metrics import TargetCounts
from specserve.telemetry import attributes as attr
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc
from specserve.wire import common_wire, target_wire


# Batched ops for the model executor: (backend, one payload per coalesced call) -> results.
# Calling through the instance keeps a subclassed backend's overrides.
def _run_verify(backend: TargetBackend, calls: list[list[VerifyInput]]) -> list[Verified]:
    return backend.verify(calls)


def _run_release(backend: TargetBackend, calls: list[list[str]]) -> list[int]:
    return backend.release(calls)


def _run_export(backend: TargetBackend, calls: list[ExportInput]) -> list[list[KvChunk]]:
    return backend.export_kv(calls)


def _run_import(backend: TargetBackend, calls: list[ImportInput]) -> list[int]:
    return backend.import_kv(calls)


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    """Serves Prefill / Verify / Release / GetLoad / ExportKv / ImportKv from a
    :class:`TargetBackend`."""

    def __init__(self, running: RunningServer[TargetBackend]) -> None:
        self.running = running
        self.executor = running.executor
        self.counts = TargetCounts()
        # Verify on the data-plane socket (specserve.serving.data_socket)
        self.verify_stream = StreamMethod("/specserve.v1.TargetService/Verify", self.verify)

    async def Prefill(
        self, request: target_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.VerifyResponse:
        with self.running.holding(request):
            backend = self.executor.backend
            inputs = target_wire.prefill_inputs(request, backend.vocab, backend.limit)
            return await self._verify(inputs, strict=False)

    async def Verify(
        self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.VerifyResponse:
        with self.running.holding(request):
            return await self.verify(request)

    async def verify(self, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        """One Verify call, unary or on the data-plane socket; errors raise (mapped by the
        caller)."""
        backend = self.executor.backend
        inputs = target_wire.verify_inputs(request, backend.vocab, backend.limit)
        return await self._verify(inputs, strict=request.strict)

    async def _verify(
        self, inputs: list[VerifyInput], *, strict: bool
    ) -> target_pb2.VerifyResponse:
        done = await self.executor.submit(
            _run_verify,
            inputs,
            key="verify",
            sessions=[x.session_id for x in inputs],
            kind="verify",
        )
        outcomes = done.value.outcomes
        self.counts.record(inputs, outcomes)
        span = trace.get_current_span()  # the call's server span
        if span.is_recording():
            span.set_attributes(
                {
                    attr.SPEC_DRAFTED: sum(len(x.proposal.tokens) for x in inputs),
                    attr.SPEC_ACCEPTED: sum(o.verdict.accepted for o in outcomes if o.verdict),
                    attr.BATCH_SIZE: done.batch_sessions,
                    attr.BATCH_CALLS: done.batch_jobs,
                    attr.QUEUE_WAIT: done.queue_s,
                    attr.COMPUTE: done.compute_ns / 1e9,
                }
            )
        if strict:
            stale = [
                x.session_id for x, o in zip(inputs, done.value.outcomes, strict=True) if o.stale
            ]
            check_strict(stale, done.value.unknown, "target")
        response = target_wire.verify_response(done.value.outcomes, inputs)
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

    async def ExportKv(
        self, request: target_pb2.ExportKvRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.ExportKvResponse:
        call = target_wire.export_input(request, self.executor.backend.vocab)
        done = await self.executor.submit(_run_export, call, sessions=[call.session_id])
        return target_pb2.ExportKvResponse(
            chunks=[target_wire.kv_chunk_pb(c) for c in done.value],
            compute_ns=done.compute_ns,
            replica_id=self.running.replica_id,
        )

    async def ImportKv(
        self, request: target_pb2.ImportKvRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.ImportKvResponse:
        with self.running.holding(request):  # chunks of KV: the largest requests there are
            call = target_wire.import_input(request, self.executor.backend.vocab)
            done = await self.executor.submit(_run_import, call, sessions=[call.session_id])
        return target_pb2.ImportKvResponse(
            tokens=done.value,
            compute_ns=done.compute_ns,
            replica_id=self.running.replica_id,
        )

    async def GetLoad(
        self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoadReport:
        backend = self.executor.backend
        load = backend.load
        kv = backend.kv_transfer
        return common_wire.load_report(
            replica_id=self.running.replica_id,
            role="target",
            model=backend.model_name,
            dtype=backend.dtype,
            sessions=load.sessions,
            kv_bytes_used=load.kv_bytes_used,
            kv_bytes_free=load.kv_bytes_free,
            queue_depth=self.executor.queue_depth(),
            progress_steps=self.executor.progress.steps,
            model_cpu_ns=self.executor.progress.cpu_ns(),
            busy=self.executor.busy(),
            tp_size=backend.tp_size,
            kv_fingerprint=kv.fingerprint if kv is not None else b"",
            kv_bytes_per_token=kv.bytes_per_token if kv is not None else 0,
            limit=backend.limit,
            data_port=self.running.data_port,
        )
