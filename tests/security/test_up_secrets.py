"""``specserve up`` keeps secrets out of its children's command lines (issue 46).

The children's argv and environment are built by :func:`specserve.cli_up.up_children`,
the function ``up`` itself calls; the orchestrator's real flag parser then reads them
back, so the password and the token do arrive, by file or environment.
"""

from __future__ import annotations

import argparse
import stat
from pathlib import Path
from unittest import mock

import pytest

from specserve.cli import build_parser
from specserve.cli_up import UpSettings, up_children
from specserve.orchestrator import config as orchestrator_config
from specserve.serving.cli_args import PairPlacement
from specserve.serving.internal_token import read_token_file

PASSWORD = "hunter2-redis-secret-9f8e7d"
AT = PairPlacement("cpu", "cpu", "float32", "float32")


def settings(tmp_path: Path, **kw: object) -> UpSettings:
    password_file = tmp_path / "redis-password"
    password_file.write_text(PASSWORD + "\n")
    base: dict[str, object] = {
        "target": "tiny:3",
        "draft": "tiny:3:noise=0.3",
        "placement": AT,
        "redis_url": "redis://127.0.0.1:6390/0",
        "redis_password_file": str(password_file),
    }
    return UpSettings(**{**base, **kw})  # type: ignore[arg-type]


Config = orchestrator_config.OrchestratorConfig


def orchestrator_reads(argv: list[str], env: dict[str, str]) -> Config:
    parser = argparse.ArgumentParser()
    orchestrator_config.add_arguments(parser, env)
    return orchestrator_config.from_args(parser.parse_args(argv))


def test_the_password_and_token_reach_the_children_by_file_or_environment(
    tmp_path: Path,
) -> None:
    children = up_children(settings(tmp_path), tmp_path)
    argvs = [children.target_args, children.draft_args, children.orchestrator_args]
    token_file = children.token_file
    assert token_file is not None
    token = read_token_file(str(token_file))
    for argv in argvs:
        line = " ".join(argv)
        assert PASSWORD not in line and token not in line
        assert argv[argv.index("--internal-token-file") + 1] == str(token_file)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert PASSWORD not in " ".join(children.orchestrator_env.values())  # a path, not the value
    config = orchestrator_reads(
        ["--target", "127.0.0.1:1", "--draft", "127.0.0.1:2", *children.orchestrator_args],
        children.orchestrator_env,
    )
    assert config.redis is not None and config.redis.password == PASSWORD
    assert config.internal_token == token
    assert token not in repr(config) and PASSWORD not in repr(config)
    assert children.warnings == []


def test_a_password_in_up_s_url_warns_and_stays_out_of_argv(tmp_path: Path) -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:6390/0"
    children = up_children(settings(tmp_path, redis_url=url, redis_password_file=None), tmp_path)
    assert all(
        PASSWORD not in " ".join(a)
        for a in (children.target_args, children.draft_args, children.orchestrator_args)
    )
    assert children.orchestrator_env["SPECSERVE_REDIS_URL"] == url
    [warning] = children.warnings
    assert "--redis-password-file" in warning and PASSWORD not in warning


def test_with_tls_up_makes_no_token(tmp_path: Path) -> None:
    tls = ("--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem")
    children = up_children(settings(tmp_path, tls_args=tls), tmp_path)
    assert children.token_file is None
    assert not (tmp_path / "internal-token").exists()
    assert "--internal-token-file" not in children.orchestrator_args
    assert children.target_args[-6:] == list(tls)


def test_up_takes_a_password_file_and_refuses_a_missing_one(tmp_path: Path) -> None:
    args = build_parser().parse_args(["up", "--tiny", "--redis-password-file", "/nonexistent"])
    assert args.redis_password_file == "/nonexistent"
    with mock.patch.dict("os.environ", {"SPECSERVE_REDIS_PASSWORD_FILE": "/from/env"}):
        assert build_parser().parse_args(["up"]).redis_password_file == "/from/env"
    from specserve.engine.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="is not a file"):
        args.func(args)
