"""The secure stack the security tests share: TLS, mutual TLS to the replicas, API keys.

The test CA is made here (:mod:`tests.security.certs`). The orchestrator serves TLS and
asks for a bearer key; the target and draft accept only clients presenting a
certificate from the CA, which the orchestrator does. One stack per package run
(``scope="package"``): the gRPC tests and the HTTP server's TLS tests use the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from specserve.client import Client, ClientTls
from specserve.orchestrator.launch import OrchestratorProcess
from specserve.serving.launch import ServerProcess
from tests.orchestrator.redis_server import free_port, redis_server
from tests.orchestrator.stack import DRAFT, ENV, SERVER_ARGS, TARGET
from tests.security.certs import Issued, make_ca

KEY_A = "key-a-0123456789abcdef"
KEY_B = "key-b-fedcba9876543210"
KEY_GENERATE_ONLY = "key-g-00112233445566778899"
PROMPT = [5, 9, 14, 5, 9, 14, 5, 9, 14, 77]


@dataclass
class SecureStack:
    ca_file: str
    rogue_ca_file: str
    orchestrator_cert: Issued
    rogue_cert: Issued
    redis_url: str
    target: ServerProcess
    target_health_port: int
    draft: ServerProcess
    orchestrator: OrchestratorProcess

    @property
    def address(self) -> str:
        return self.orchestrator.address

    def client(self, api_key: str | None = KEY_A) -> Client:
        return Client(self.address, timeout_s=60, tls=ClientTls(self.ca_file), api_key=api_key)


def replica_flags(issued: Issued, ca_file: str) -> list[str]:
    return ["--tls-cert", issued.cert, "--tls-key", issued.key, "--tls-ca", ca_file]


@pytest.fixture(scope="package")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureStack]:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = make_ca(d, "specserve"), make_ca(d, "rogue")
    orch_cert = ca.issue("orchestrator")
    keys_file = d / "api-keys"
    keys_file.write_text(
        f"# test keys\n{KEY_A}\n\n{KEY_B}  generate,sessions  # both scopes\n"
        f"{KEY_GENERATE_ONLY} generate\n"
    )
    as_orchestrator = ClientTls(ca.ca_file, orch_cert.cert, orch_cert.key)
    health_port = free_port()
    with redis_server() as url:
        target = ServerProcess(
            "target",
            [
                "--model",
                TARGET,
                *SERVER_ARGS,
                *replica_flags(ca.issue("target"), ca.ca_file),
                "--health-port",
                str(health_port),
            ],
            env=ENV,
            tls=as_orchestrator,
        )
        draft = ServerProcess(
            "draft",
            ["--model", DRAFT, *SERVER_ARGS, *replica_flags(ca.issue("draft"), ca.ca_file)],
            env=ENV,
            tls=as_orchestrator,
        )
        procs: list[ServerProcess] = [target, draft]
        try:
            for p in procs:
                p.start()
            orchestrator = OrchestratorProcess(
                [
                    "--target",
                    target.address,
                    "--draft",
                    draft.address,
                    "--redis-url",
                    url,
                    *replica_flags(orch_cert, ca.ca_file),
                    "--api-keys-file",
                    str(keys_file),
                ],
                env=ENV,
                tls=ClientTls(ca.ca_file),
            )
            procs.append(orchestrator)
            orchestrator.start()
            for p in procs:
                p.wait_serving()
            yield SecureStack(
                ca.ca_file,
                rogue.ca_file,
                orch_cert,
                rogue.issue("intruder"),
                url,
                target,
                health_port,
                draft,
                orchestrator,
            )
        finally:
            for p in reversed(procs):
                p.stop()
