"""A small OTLP/gRPC trace receiver: what the tests and benchmarks point the servers at.

It implements the collector's ``TraceService.Export`` on a loopback port and
keeps every span it receives as a :class:`ReceivedSpan` (ids in hex, times in
nanoseconds, attributes as plain values, the resource's attributes beside each
span). Point a process at it with ``OTEL_EXPORTER_OTLP_ENDPOINT=http://HOST:PORT``
and ``--trace-exporter otlp``. Not a collector: no batching limits, no
persistence; a test-and-benchmark tool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

KINDS = {
    trace_pb2.Span.SPAN_KIND_INTERNAL: "internal",
    trace_pb2.Span.SPAN_KIND_SERVER: "server",
    trace_pb2.Span.SPAN_KIND_CLIENT: "client",
    trace_pb2.Span.SPAN_KIND_PRODUCER: "producer",
    trace_pb2.Span.SPAN_KIND_CONSUMER: "consumer",
}


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root span
    name: str
    kind: str  # "internal", "server", "client", ...
    start_ns: int  # Unix time
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: tuple[tuple[str, str], ...] = ()  # (trace id, span id) of each link
    events: tuple[str, ...] = ()
    status_error: bool = False

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))


def _value(v: common_pb2.AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def convert(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """An export request -> its spans."""
    out = []
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=KINDS.get(s.kind, "unspecified"),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attributes(s.attributes),
                        resource=resource,
                        links=tuple((ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links),
                        events=tuple(e.name for e in s.events),
                        status_error=s.status.code == trace_pb2.Status.STATUS_CODE_ERROR,
                    )
                )
    return out


@dataclass
class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = convert(request)
        with self.lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class TraceReceiver:
    """An OTLP/gRPC receiver on ``host``, port 0 by default (a context manager)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._servicer = _Servicer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self._servicer, self._server)
        self.host = host
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not bind {host}:{port}")

    @property
    def endpoint(self) -> str:
        """The value for ``OTEL_EXPORTER_OTLP_ENDPOINT`` (OTLP over gRPC, no TLS)."""
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment that sends a process's spans here, exported within ~0.1 s."""
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }

    def start(self) -> TraceReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far."""
        with self._servicer.lock:
            return list(self._servicer.spans)

    def clear(self) -> None:
        with self._servicer.lock:
            self._servicer.spans.clear()

    def wait_for(
        self, check: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 10.0
    ) -> list[ReceivedSpan]:
        """Poll until ``check(spans)`` holds; returns the spans (raises TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if check(spans):
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"spans not received in {timeout_s} s ({len(spans)} so far)")
            time.sleep(0.05)

    def __enter__(self) -> TraceReceiver:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
