"""Malformed bytes and bad KV snapshots, end to end (issue 24, findings 7 and 9).

* Bytes that do not parse as a method's request message get INVALID_ARGUMENT with a
  sentence on every public and internal method (and health), and each process logs
  one WARNING line for the lot (rate-limited), no ERROR traceback.
* ExportKv refuses tokens other than the ones the target's cache was computed from;
  ImportKv refuses chunks holding NaN or infinity.
"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from specserve.engine.kv_chunks import chunk_digest
from specserve.serving.launch import ServerProcess
from specserve.v1 import common_pb2, draft_pb2, generate_pb2, target_pb2, target_pb2_grpc
from tests.orchestrator.stack import Stack

pytestmark = pytest.mark.redis

# Field 1, length-delimited, with a length varint that never ends: no message parses it.
GARBAGE = b"\x0a\xff\xff\xff\xff\xff\xff"


def methods(module: object) -> list[tuple[str, bool]]:
    """(full method path, server-streaming) of every method of the module's services."""
    out = []
    for service in module.DESCRIPTOR.services_by_name.values():  # type: ignore[attr-defined]
        for m in service.methods:
            out.append((f"/{service.full_name}/{m.name}", m.server_streaming))
    return out


HEALTH = [("/grpc.health.v1.Health/Check", False)]


def send_garbage(address: str, method: str, streaming: bool) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        if streaming:
            call = channel.unary_stream(method)
            with pytest.raises(grpc.RpcError) as info:
                list(call(GARBAGE, timeout=10))
        else:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(method)(GARBAGE, timeout=10)
    return info.value


def test_malformed_bytes_get_invalid_argument_and_one_warning(stack: Stack) -> None:
    assert stack.draft is not None and stack.orchestrator is not None
    processes: list[tuple[ServerProcess, list[tuple[str, bool]]]] = [
        (stack.orchestrator, methods(generate_pb2) + HEALTH),
        (stack.target_procs[0], methods(target_pb2) + HEALTH),
        (stack.draft, methods(draft_pb2) + HEALTH),
    ]
    if any("that is not a" in p.output() for p, _ in processes):
        time.sleep(10.5)  # past an earlier test's warning: this test's lines start a window
    logged = {p.address: len(p.output()) for p, _ in processes}
    count = 0
    for proc, calls in processes:
        for method, streaming in calls:
            error = send_garbage(proc.address, method, streaming)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, error)
            assert "does not parse as a" in error.details(), (method, error.details())
            count += 1
    assert count == (5 + 1) + (6 + 1) + (3 + 1)  # each service's methods + health
    time.sleep(0.5)  # let the logs flush
    for proc, _ in processes:
        log = proc.output()[logged[proc.address] :]
        assert "Traceback" not in log and " ERROR " not in log, log
        warnings = [line for line in log.splitlines() if "that is not a" in line]
        assert len(warnings) == 1, (proc.role, warnings)
        assert proc.health() == health_pb2.HealthCheckResponse.SERVING


def test_export_kv_checks_tokens_and_import_kv_refuses_non_finite_values(stack: Stack) -> None:
    tokens = [(7 * i + 3) % 256 for i in range(32)]
    with grpc.insecure_channel(stack.target_procs[0].address) as channel:
        target = target_pb2_grpc.TargetServiceStub(channel)
        prefill = target_pb2.PrefillRequest()
        prefill.sessions.add(session_id="kv-check", tokens=tokens)
        target.Prefill(prefill, timeout=30)
        try:
            wrong = [*tokens[:20], (tokens[20] + 1) % 256, *tokens[21:]]
            with pytest.raises(grpc.RpcError) as info:
                target.ExportKv(
                    target_pb2.ExportKvRequest(
                        session_id="kv-check", tokens=wrong, chunk_tokens=16
                    ),
                    timeout=30,
                )
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not the ones the cache was computed from" in info.value.details()
            good = target.ExportKv(
                target_pb2.ExportKvRequest(session_id="kv-check", tokens=tokens, chunk_tokens=16),
                timeout=30,
            )
            assert len(good.chunks) == 2
            poisoned = target_pb2.KvChunk()
            poisoned.CopyFrom(good.chunks[0])
            nan = b"\x00\x00\xc0\x7f"  # float32 NaN, little-endian
            poisoned.data = nan + poisoned.data[4:]
            # resealed (this stack has no internal token: the digest is unkeyed), so the
            # non-finite check, not the digest, refuses it
            poisoned.digest = chunk_digest(poisoned.key, poisoned.data)
            for chunk, ok in ((poisoned, False), (good.chunks[0], True)):
                req = target_pb2.ImportKvRequest(
                    session_id="kv-import", tokens=tokens[:16], start=0, chunks=[chunk]
                )
                if ok:
                    assert target.ImportKv(req, timeout=30).tokens == 16
                    continue
                with pytest.raises(grpc.RpcError) as info:
                    target.ImportKv(req, timeout=30)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "non-finite" in info.value.details()
            # The imported cache knows its tokens: exporting it back checks them too.
            with pytest.raises(grpc.RpcError) as info:
                target.ExportKv(
                    target_pb2.ExportKvRequest(
                        session_id="kv-import", tokens=wrong[:16][::-1], chunk_tokens=16
                    ),
                    timeout=30,
                )
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            target.Release(
                common_pb2.ReleaseRequest(session_ids=["kv-check", "kv-import"]), timeout=10
            )
