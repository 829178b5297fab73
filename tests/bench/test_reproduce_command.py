"""A results file's reproduce line carries the SPECSERVE_* settings the run had, and
nothing private (paths of the machine, secrets)."""

from __future__ import annotations

import os
import shlex

import pytest

from bench.common import reproduce_command


def test_settings_from_the_environment_lead_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("SPECSERVE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("SPECSERVE_K_ZERO_AT", "2")
    monkeypatch.setenv("SPECSERVE_DEVICES", "shared")
    monkeypatch.setenv("SPECSERVE_HOME", "/somewhere/private")
    monkeypatch.setenv("SPECSERVE_REDIS_URL", "redis://user:secret@host:6379")
    monkeypatch.setenv("SPECSERVE_REDIS_PASSWORD", "secret")
    assert reproduce_command("bench.concurrency", ["--reps", "2"]) == (
        "SPECSERVE_DEVICES=shared SPECSERVE_K_ZERO_AT=2 "
        ".venv/bin/python -m bench.concurrency --reps 2"
    )


def test_paths_of_the_machine_keep_only_their_last_part() -> None:
    assert reproduce_command(
        "bench.concurrency", ["--logs", "/some/where/run-logs", "--reps", "1"]
    ).endswith(".venv/bin/python -m bench.concurrency --logs run-logs --reps 1")
    assert reproduce_command("bench.k_policy_replay", ["--replay=/some/where/a b.json"]).endswith(
        "-m bench.k_policy_replay --replay='a b.json'"
    )


def test_an_argument_with_spaces_comes_back_as_one_word() -> None:
    line = reproduce_command(
        "bench.experiments.first_request", ["--prompt", "def fib(n):", "--new-tokens", "96"]
    )
    words = shlex.split(line)
    assert words[words.index("--prompt") + 1] == "def fib(n):"
