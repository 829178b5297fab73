"""The API keys file and the bearer check, without a server; and the TLS flags' errors."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import grpc
import pytest

from specserve.draft_service import config as draft_config
from specserve.engine.errors import InvalidArgument
from specserve.orchestrator import config as orchestrator_config
from specserve.orchestrator.api.api_keys import RELOAD_CHECK_S, ApiKeys, KeysFile, Refused, owner_of
from specserve.serving.tls import ClientTls
from tests.security.certs import make_ca

KEY = "k" * 16
OTHER = "0123456789abcdef-other"


def refused(keys: ApiKeys, metadata: list[tuple[str, str]], method: str) -> Refused:
    with pytest.raises(Refused) as e:
        keys.authenticate(metadata, method)
    return e.value


def test_file_format_comments_scopes_and_fingerprints() -> None:
    keys = ApiKeys.parse(f"# all\n\n{KEY}   # trailing comment\n{OTHER} generate\n")
    assert len(keys) == 2
    caller = keys.authenticate([("authorization", f"Bearer {KEY}")], "CloseSession")
    assert caller.fingerprint == hashlib.sha256(KEY.encode()).digest()
    assert caller.scopes == {"generate", "sessions"} and KEY not in caller.key_id
    assert keys.authenticate([("authorization", f"bearer {OTHER}")], "Generate").scopes == {
        "generate"
    }
    assert owner_of(keys, [("authorization", f"Bearer {KEY}")]) == caller.fingerprint
    assert owner_of(None, []) == b""


@pytest.mark.parametrize(
    ("metadata", "code", "words"),
    [
        ([], grpc.StatusCode.UNAUTHENTICATED, "needs an API key"),
        ([("authorization", f"Basic {KEY}")], grpc.StatusCode.UNAUTHENTICATED, "Bearer <key>"),
        ([("authorization", "Bearer unknown-key-0000000")], grpc.StatusCode.UNAUTHENTICATED, ""),
        ([("authorization", f"Bearer {OTHER}")], grpc.StatusCode.PERMISSION_DENIED, "scope"),
    ],
)
def test_refusals(metadata: list[tuple[str, str]], code: grpc.StatusCode, words: str) -> None:
    keys = ApiKeys.parse(f"{KEY}\n{OTHER} generate\n")
    r = refused(keys, metadata, "GetSession")
    assert r.code == code and words in str(r)
    assert KEY not in str(r) and OTHER not in str(r)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("short\n", "line 1: a key is 16 to 512"),
        (f"# only a comment\n{KEY} admin\n", "line 2: unknown scope 'admin'"),
        (f"{KEY}\n{KEY} generate\n", "line 2: the same key is listed twice"),
        ("# nothing\n\n", "lists no key"),
    ],
)
def test_bad_files_name_the_line_and_never_the_key(text: str, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words) as e:
        ApiKeys.parse(text)
    assert KEY not in str(e.value)


def orchestrator_args(*more: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    orchestrator_config.add_arguments(parser, {})
    return parser.parse_args(["--target", "127.0.0.1:1", *more])


def test_orchestrator_flags(tmp_path: Path) -> None:
    ca = make_ca(tmp_path)
    pair = ca.issue("orchestrator")
    tls = ["--tls-cert", pair.cert, "--tls-key", pair.key]
    config = orchestrator_config.from_args(orchestrator_args(*tls, "--tls-ca", ca.ca_file))
    assert config.server.tls is not None and config.server.tls.client_ca_file is None
    assert config.replica_tls == ClientTls(ca.ca_file, pair.cert, pair.key)
    plain_replicas = orchestrator_config.from_args(orchestrator_args(*tls))
    assert plain_replicas.replica_tls is None
    assert any("channels to the replicas are plaintext" in w for w in plain_replicas.warnings)
    exposed = orchestrator_config.from_args(orchestrator_args("--host", "0.0.0.0"))
    assert any("without --api-keys-file" in w for w in exposed.warnings)
    with pytest.raises(InvalidArgument, match="--tls-cert needs --tls-key"):
        orchestrator_config.from_args(orchestrator_args("--tls-cert", pair.cert))
    with pytest.raises(InvalidArgument, match="cannot read --tls-ca"):
        orchestrator_config.from_args(orchestrator_args("--tls-ca", str(tmp_path / "none")))
    with pytest.raises(InvalidArgument, match="no PEM block"):
        orchestrator_config.from_args(orchestrator_args("--tls-ca", __file__))
    with pytest.raises(InvalidArgument, match="cannot read --api-keys-file"):
        orchestrator_config.from_args(orchestrator_args("--api-keys-file", str(tmp_path / "x")))


def test_replica_flags(tmp_path: Path) -> None:
    ca = make_ca(tmp_path)
    pair = ca.issue("draft")
    parser = argparse.ArgumentParser()
    draft_config.add_arguments(parser, {})
    args = parser.parse_args(
        [
            "--model",
            "tiny:1",
            "--tls-cert",
            pair.cert,
            "--tls-key",
            pair.key,
            "--tls-ca",
            ca.ca_file,
        ]
    )
    tls = draft_config.from_args(args).server.tls
    assert tls is not None and tls.client_ca_file == ca.ca_file  # mutual TLS
    with pytest.raises(InvalidArgument, match="needs --tls-cert and --tls-key"):
        draft_config.from_args(parser.parse_args(["--model", "tiny:1", "--tls-ca", ca.ca_file]))


def test_the_keys_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{KEY}\n{OTHER}\n")
    now = [0.0]
    keys_file = KeysFile(str(path), clock=lambda: now[0])
    bearer = [("authorization", f"Bearer {OTHER}")]
    assert keys_file.current().authenticate(bearer, "Generate")
    path.write_text(f"{KEY}\n")  # OTHER revoked
    assert keys_file.current().authenticate(bearer, "Generate")  # not checked again yet
    now[0] += RELOAD_CHECK_S
    assert refused(keys_file.current(), bearer, "Generate").code == grpc.StatusCode.UNAUTHENTICATED
    path.write_text("not a key file at all\n")
    now[0] += RELOAD_CHECK_S
    assert len(keys_file.current()) == 1  # a broken file keeps the keys in force
