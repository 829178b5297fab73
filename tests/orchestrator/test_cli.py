"""``specserve up`` and ``specserve generate --orchestrator`` through their argument parsers."""

from __future__ import annotations

import argparse

import pytest

from specserve import cli_generate, cli_orchestrator
from tests.orchestrator.redis_server import free_port
from tests.orchestrator.stack import Stack

pytestmark = pytest.mark.redis


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve")
    sub = p.add_subparsers(dest="command", required=True)
    cli_orchestrator.add_parsers(sub)
    cli_generate.add_parser(sub)
    return p


def test_generate_against_a_running_orchestrator(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parser().parse_args(
        [
            "generate",
            "5 6 7 5 6 7",
            "--orchestrator",
            stack.address,
            "--max-new-tokens",
            "12",
            "-k",
            "3",
        ]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "12 tokens" in out and "tok/s" in out and "acceptance" in out


def test_up_starts_the_stack_and_answers_one_request(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parser().parse_args(
        [
            "up",
            "--tiny",
            "--once",
            "--port",
            str(free_port()),
            "--threads",
            "1",
            "--max-new-tokens",
            "16",
            "--redis-url",
            redis_url,
        ]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "target tiny:3 (cpu) on 127.0.0.1:" in out and "orchestrator on 127.0.0.1:" in out
    assert "16 tokens" in out and "acceptance" in out
