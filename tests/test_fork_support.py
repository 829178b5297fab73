"""Importing specserve turns gRPC's fork support off unless the environment says
otherwise (specserve/__init__.py says why: children started with a ``preexec_fn`` died
before their exec when gRPC restarted its poller in the forked child)."""

from __future__ import annotations

import os
import subprocess
import sys


def _after_import(env: dict[str, str]) -> str:
    code = "import specserve, os, grpc; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_importing_specserve_turns_grpc_fork_support_off() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    assert _after_import(env) == "false"


def test_an_explicit_setting_is_kept() -> None:
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "true"}
    assert _after_import(env) == "true"
