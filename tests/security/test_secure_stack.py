"""A whole stack with TLS, mutual TLS to the replicas and API keys, on real processes.

The stack is the package's (``tests/security/conftest.py``). The orchestrator serves TLS and
asks for a bearer key; the target and draft accept only clients presenting a
certificate from the CA, which the orchestrator does. Shown: greedy generation over it
all equals target-only decoding (with drafts accepted, so the draft channel works too);
a plaintext or wrong-CA client gets nowhere; a replica refuses callers without a
certificate from the CA, including a whole orchestrator; no key or a wrong key is
UNAUTHENTICATED, a key without the scope PERMISSION_DENIED; health and reflection
answer without a key; a second key sees none of the first key's sessions (NOT_FOUND
for get, continue, cancel and close, even mid-generation), and the record keeps a
fingerprint of the key, not the key.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specserve.client import Client, ClientTls
from specserve.orchestrator.launch import OrchestratorProcess
from specserve.serving.data_frames import frame, read_frame
from specserve.serving.malformed import Oversized
from specserve.serving.replica_connection import ReplicaConnection
from specserve.serving.socket_call import SocketCall, SocketDial
from specserve.serving.tls import aio_channel, sync_channel
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.orchestrator.stack import ENV, Reference, stored_record
from tests.security.conftest import (
    KEY_A,
    KEY_B,
    KEY_GENERATE_ONLY,
    PROMPT,
    SecureStack,
)

pytestmark = pytest.mark.redis

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE  # a refused handshake: the call never reaches a server


def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_generation_over_tls_equals_target_only(secure: SecureStack) -> None:
    expected = Reference().decode(PROMPT, 24)
    with secure.client() as c:
        got = c.generate(PROMPT, max_new_tokens=24, drafter="model", k=4)
    assert got.token_ids == expected
    assert got.usage.drafted_tokens > 0 and got.usage.accepted_tokens > 0  # the draft's mTLS
    assert "mutual TLS" in secure.orchestrator.output()


def test_plaintext_and_wrong_ca_clients_are_refused(secure: SecureStack) -> None:
    with Client(secure.address, timeout_s=10, api_key=KEY_A) as plain:
        assert code_of(lambda: plain.generate(PROMPT, max_new_tokens=2)) == UNAVAILABLE
    with Client(
        secure.address, timeout_s=10, tls=ClientTls(secure.rogue_ca_file), api_key=KEY_A
    ) as wrong_ca:
        assert code_of(lambda: wrong_ca.generate(PROMPT, max_new_tokens=2)) == UNAVAILABLE


def get_load(address: str, tls: ClientTls | None) -> int:
    """GetLoad of a target: the sessions it holds."""
    with sync_channel(address, tls) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        return stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10).sessions


def test_a_replica_accepts_only_client_certificates_from_its_ca(secure: SecureStack) -> None:
    ca, rogue = secure.ca_file, secure.rogue_cert
    address = secure.target.address
    mine = secure.orchestrator_cert
    assert get_load(address, ClientTls(ca, mine.cert, mine.key)) >= 0
    for tls in (None, ClientTls(ca), ClientTls(ca, rogue.cert, rogue.key)):
        assert code_of(lambda tls=tls: get_load(address, tls)) == grpc.StatusCode.UNAVAILABLE


def socket_verify_code(address: str, tls: ClientTls | None) -> grpc.StatusCode:
    """The code a Verify on the target's data-plane socket ends with (the request names
    a token outside the vocabulary: INVALID_ARGUMENT once it reaches the servicer)."""
    bad = target_pb2.VerifyRequest(
        sessions=[target_pb2.VerifySession(session_id="tls-probe", new_tokens=[1, 1 << 30])]
    )

    async def main() -> grpc.StatusCode:
        async with aio_channel(address, tls) as channel:
            stream = ReplicaConnection.verify(channel, SocketDial.of(address, tls))
            try:
                await stream.call(bad, 10)
            except grpc.aio.AioRpcError as e:
                over = isinstance(stream._connection, SocketCall) and stream._connection.connected
                assert e.code() != INVALID_ARGUMENT or over, "not over the socket"
                return e.code()
            finally:
                await stream.close()
        return grpc.StatusCode.OK

    return asyncio.run(main())


def test_the_data_plane_socket_serves_tls_and_needs_a_client_certificate_from_the_ca(
    secure: SecureStack,
) -> None:
    ca, rogue, mine = secure.ca_file, secure.rogue_cert, secure.orchestrator_cert
    address = secure.target.address
    assert socket_verify_code(address, ClientTls(ca, mine.cert, mine.key)) == INVALID_ARGUMENT
    for tls in (None, ClientTls(ca), ClientTls(ca, rogue.cert, rogue.key)):
        assert socket_verify_code(address, tls) == grpc.StatusCode.UNAVAILABLE
    with sync_channel(address, ClientTls(ca, mine.cert, mine.key)) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        port = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10).data_port
    assert port
    assert socket_hello(port, ClientTls(ca, mine.cert, mine.key)) == b""  # accepted
    for tls in (None, ClientTls(ca), ClientTls(ca, rogue.cert, rogue.key)):
        assert socket_hello(port, tls) is None  # no TLS, or no certificate from the CA


def socket_hello(port: int, tls: ClientTls | None) -> bytes | None:
    """The target socket's reply to a hello over ``tls``; None if the connection failed."""

    async def main() -> bytes | None:
        dial = SocketDial.of(f"127.0.0.1:{port}", tls)
        try:
            reader, writer = await asyncio.open_connection(
                dial.host, port, ssl=dial.ssl_context(), server_hostname=dial.host if tls else None
            )
            writer.write(frame(b"/specserve.v1.TargetService/Verify"))
            reply = await asyncio.wait_for(read_frame(reader, 1 << 16), 10)
            writer.close()
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
            return None
        assert not isinstance(reply, Oversized)
        return reply

    return asyncio.run(main())


def test_an_orchestrator_without_a_client_certificate_cannot_use_the_replicas(
    secure: SecureStack,
) -> None:
    lone = OrchestratorProcess(
        [
            "--target",
            secure.target.address,
            "--draft",
            secure.draft.address,
            "--redis-url",
            secure.redis_url,
            "--tls-ca",
            secure.ca_file,  # trusts the replicas, but presents no certificate
            "--failover-s",
            "1",
        ],
        env=ENV,
    )
    with lone:
        lone.wait_serving()
        with Client(lone.address, timeout_s=30) as c, pytest.raises(grpc.RpcError) as e:
            c.generate(PROMPT, max_new_tokens=4)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "target" in e.value.details()


def test_the_health_port_serves_health_alone_in_plaintext(secure: SecureStack) -> None:
    """Kubernetes' gRPC probes cannot speak TLS: --health-port answers them, and only them."""
    address = f"127.0.0.1:{secure.target_health_port}"
    with sync_channel(address, None) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="specserve.v1.TargetService"), timeout=10
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        get_load(address, None)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_no_key_or_a_wrong_key_is_unauthenticated(secure: SecureStack) -> None:
    for key in (None, "not-a-key-of-this-server-000"):
        with secure.client(api_key=key) as c:
            calls = [
                lambda c=c: c.generate(PROMPT, max_new_tokens=2),
                lambda c=c: list(c.stream(PROMPT, max_new_tokens=2)),
                lambda c=c: c.get_session("anything"),
                lambda c=c: c.cancel("anything"),
                lambda c=c: c.close_session("anything"),
            ]
            for call in calls:
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "API key" in e.value.details()
    with sync_channel(secure.address, ClientTls(secure.ca_file)) as channel:
        stub = channel.unary_unary("/specserve.v1.Generation/GetSession")
        for header in ("Basic a2V5OmtleQ==", f"Bearer{KEY_A}", KEY_A):
            with pytest.raises(grpc.RpcError) as e:
                stub(b"", metadata=(("authorization", header),), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_key_without_the_scope_is_permission_denied(secure: SecureStack) -> None:
    with secure.client(api_key=KEY_GENERATE_ONLY) as c:
        kept = c.generate(PROMPT, max_new_tokens=2, keep_session=True)
        with pytest.raises(grpc.RpcError) as e:
            c.get_session(kept.session_id)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "scope 'sessions'" in e.value.details()


def test_health_and_reflection_need_no_key(secure: SecureStack) -> None:
    with sync_channel(secure.address, ClientTls(secure.ca_file)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = list(reflect.ServerReflectionInfo(iter([request]), timeout=10))
        names = {s.name for s in answer.list_services_response.service}
        assert "specserve.v1.Generation" in names


def test_a_second_key_cannot_see_or_touch_the_first_keys_session(secure: SecureStack) -> None:
    with secure.client(KEY_A) as a, secure.client(KEY_B) as b:
        sid = a.generate(PROMPT, max_new_tokens=4, keep_session=True).session_id
        assert a.get_session(sid).session_id == sid
        attempts = {
            "get": lambda: b.get_session(sid),
            "continue": lambda: b.generate([3, 4], max_new_tokens=2, session_id=sid),
            "cancel": lambda: b.cancel(sid),
            "close": lambda: b.close_session(sid),
        }
        for name, call in attempts.items():
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, name
            assert sid in e.value.details() and "does not exist" in e.value.details()
        # Exactly what a session that does not exist gets: B learns nothing.
        with pytest.raises(grpc.RpcError) as none:
            b.get_session("0" * 32)
        assert none.value.code() == grpc.StatusCode.NOT_FOUND

        record = stored_record(secure.redis_url, sid)
        assert record.owner == hashlib.sha256(KEY_A.encode()).digest()
        assert KEY_A.encode() not in record.SerializeToString()

        # Mid-generation, B can neither cancel nor close A's session; A's turn runs on.
        stream = a.stream([7, 8], max_new_tokens=400, session_id=sid, keep_session=True)
        deltas = iter(stream)
        first = next(deltas)
        assert first.session_id == sid
        for call in (lambda: b.cancel(sid), lambda: b.close_session(sid)):
            assert code_of(call) == grpc.StatusCode.NOT_FOUND
        rest = list(deltas)
        assert rest[-1].finish_reason == "length"
        assert sum(len(d.token_ids) for d in [first, *rest]) == 400
        assert a.get_session(sid).session_id == sid  # A still owns it
        assert a.close_session(sid)


def test_keys_file_needs_no_secret_in_argv(secure: SecureStack) -> None:
    assert all(key not in " ".join(secure.orchestrator.args) for key in (KEY_A, KEY_B))
    assert KEY_A not in secure.orchestrator.output()
    assert Path(secure.ca_file).exists()
