"""``scripts/make-test-ca.sh`` (what docs/security.md tells operators to run) makes
certificates a replica serves mutual TLS with, and replicas found by DNS are checked
against the DNS name, not the IP address dialled (a real target process)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from specserve.orchestrator.fleet.replicas import EndpointSpec, ReplicaPool
from specserve.serving.launch import ServerProcess
from specserve.serving.tls import ClientTls, sync_channel
from specserve.v1 import common_pb2, target_pb2_grpc
from tests.orchestrator.stack import ENV, SERVER_ARGS, TARGET

SCRIPT = Path(__file__).parents[2] / "scripts" / "make-test-ca.sh"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    # The target's certificate names only DNS:localhost: dialling 127.0.0.1 must use the name.
    subprocess.run(
        ["bash", str(SCRIPT), str(d), "orchestrator", "target=DNS:localhost"],
        check=True,
        capture_output=True,
    )
    return d


@pytest.fixture(scope="module")
def target(pki: Path) -> Iterator[ServerProcess]:
    flags = ["--tls-cert", str(pki / "target.crt"), "--tls-key", str(pki / "target.key")]
    flags += ["--tls-ca", str(pki / "ca.crt")]
    as_orchestrator = orchestrator_tls(pki, server_name="localhost")
    with ServerProcess(
        "target", ["--model", TARGET, *SERVER_ARGS, *flags], env=ENV, tls=as_orchestrator
    ) as t:
        yield t.wait_serving()


def orchestrator_tls(pki: Path, server_name: str | None = None) -> ClientTls:
    return ClientTls(
        str(pki / "ca.crt"),
        str(pki / "orchestrator.crt"),
        str(pki / "orchestrator.key"),
        server_name=server_name,
    )


def get_load(address: str, tls: ClientTls) -> str:
    with sync_channel(address, tls) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        return stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10).replica_id


def test_script_certificates_serve_mutual_tls(pki: Path, target: ServerProcess) -> None:
    assert oct((pki / "ca.key").stat().st_mode & 0o777) == "0o600"
    assert get_load(target.address, orchestrator_tls(pki, server_name="localhost"))
    with pytest.raises(grpc.RpcError) as e:  # 127.0.0.1 is not a name in the certificate
        get_load(target.address, orchestrator_tls(pki))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    without_cert = ClientTls(str(pki / "ca.crt"), server_name="localhost")
    with pytest.raises(grpc.RpcError) as e:
        get_load(target.address, without_cert)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_dns_replica_is_checked_against_its_dns_name(pki: Path, target: ServerProcess) -> None:
    async def load_via_dns() -> str:
        spec = EndpointSpec.parse(f"dns:///localhost:{target.port}", "target")
        pool = ReplicaPool(
            "target", spec, target_pb2_grpc.TargetServiceStub, tls=orchestrator_tls(pki)
        )
        await pool.start()
        try:
            endpoint = f"127.0.0.1:{target.port}"
            assert endpoint in pool.endpoints()  # dialled by IP address
            replica = pool.get(endpoint)
            assert replica is not None
            reply = await replica.stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)
            return reply.replica_id
        finally:
            await pool.close()

    assert asyncio.run(load_via_dns())
