"""The Redis password comes from a file or the environment; on the command line it warns
and is never echoed (a real orchestrator process, a real password-protected Redis).

Each orchestrator reads a session that does not exist (GetSession -> NOT_FOUND): an
answer that needs an authenticated Redis connection. A wrong password turns that into
UNAVAILABLE, and the log still holds no password.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from specserve.client import Client
from specserve.orchestrator import config as orchestrator_config
from specserve.orchestrator.launch import OrchestratorProcess
from specserve.orchestrator.store.redis_settings import redacted, url_has_password
from tests.orchestrator.redis_server import redis_server
from tests.orchestrator.stack import ENV

pytestmark = pytest.mark.redis

PASSWORD = "hunter2-redis-Pa55word"
# No replica is needed to read a session; the target only has to be a valid endpoint.
NO_TARGET = ["--target", "127.0.0.1:9"]


@pytest.fixture(scope="module")
def redis_with_password() -> Iterator[str]:
    """The URL of a Redis that requires PASSWORD, without the password in it."""
    with redis_server(PASSWORD) as url:
        yield url.replace(f":{PASSWORD}@", "")


def run_orchestrator(args: list[str], env: dict[str, str] | None = None) -> tuple[str, str]:
    """Start one, read a missing session, stop it; (the call's status name, its whole log)."""
    with OrchestratorProcess([*NO_TARGET, *args], env={**ENV, **(env or {})}) as orch:
        orch.wait_serving()
        with Client(orch.address, timeout_s=20) as c:
            try:
                c.get_session("no-such-session")
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
                assert PASSWORD not in (e.details() or "")
        orch.stop()
        return code, orch.output()


def test_a_password_in_the_url_warns_and_is_not_echoed(redis_with_password: str) -> None:
    url = redis_with_password.replace("redis://", f"redis://:{PASSWORD}@")
    code, log = run_orchestrator(["--redis-url", url])
    assert code == "NOT_FOUND"  # it authenticated
    assert "--redis-url URL carries a password" in log and "redis://:***@127.0.0.1" in log
    assert PASSWORD not in log


def test_a_password_flag_warns_and_is_not_echoed(redis_with_password: str) -> None:
    code, log = run_orchestrator(["--redis-url", redis_with_password, "--redis-password", PASSWORD])
    assert code == "NOT_FOUND"
    assert "--redis-password puts the password in the process list" in log
    assert PASSWORD not in log


def test_a_password_file_or_the_environment_is_quiet(
    redis_with_password: str, tmp_path: Path
) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD + "\n")  # as `echo` or a mounted Secret leaves it
    code, log = run_orchestrator(
        ["--redis-url", redis_with_password, "--redis-password-file", str(secret)]
    )
    assert code == "NOT_FOUND" and "password" not in log.lower()
    code, log = run_orchestrator(
        ["--redis-url", redis_with_password], env={"SPECSERVE_REDIS_PASSWORD": PASSWORD}
    )
    assert code == "NOT_FOUND" and "password" not in log.lower()


def test_a_wrong_password_fails_without_echoing_it(
    redis_with_password: str, tmp_path: Path
) -> None:
    secret = tmp_path / "wrong"
    secret.write_text("wrong-" + PASSWORD)
    code, log = run_orchestrator(
        ["--redis-url", redis_with_password, "--redis-password-file", str(secret)]
    )
    assert code == "UNAVAILABLE"
    assert PASSWORD not in log


def test_help_shows_no_password_from_the_environment() -> None:
    parser = argparse.ArgumentParser()
    orchestrator_config.add_arguments(
        parser, {"SPECSERVE_REDIS_PASSWORD": PASSWORD, "SPECSERVE_TARGET_ENDPOINTS": "h:1"}
    )
    assert PASSWORD not in parser.format_help()
    args = parser.parse_args(["--redis-url", "redis://127.0.0.1:6379/0"])
    config = orchestrator_config.from_args(args)
    assert config.redis is not None and config.redis.password == PASSWORD
    assert config.warnings == ()  # the environment is a fine place for it
    assert PASSWORD not in repr(config)


def test_both_password_flags_are_refused_without_echo(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    orchestrator_config.add_arguments(parser, {})
    secret = tmp_path / "p"
    secret.write_text(PASSWORD)
    args = parser.parse_args(
        [
            *NO_TARGET,
            "--redis-url",
            "redis://h:1/0",
            "--redis-password",
            PASSWORD,
            "--redis-password-file",
            str(secret),
        ]
    )
    with pytest.raises(Exception, match="not both") as e:
        orchestrator_config.from_args(args)
    assert PASSWORD not in str(e.value)


def test_redaction() -> None:
    assert redacted(f"redis://user:{PASSWORD}@h:1/0") == "redis://user:***@h:1/0"
    assert redacted("rediss://h:1/0") == "rediss://h:1/0"
    assert url_has_password(f"redis://:{PASSWORD}@h") and not url_has_password("redis://u@h")
