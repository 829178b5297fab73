"""TP flags -> settings, their validation, and which torchrun process is a worker."""

from __future__ import annotations

import argparse

import pytest

from specserve.engine.errors import InvalidArgument
from specserve.target_service.tp_config import (
    TPSettings,
    add_tp_arguments,
    is_torchrun_worker,
    tp_settings,
)

pytestmark = pytest.mark.tp


def _parse(argv: list[str], env: dict[str, str] | None = None) -> TPSettings:
    parser = argparse.ArgumentParser()
    add_tp_arguments(parser, env or {})
    return tp_settings(parser.parse_args(argv), num_threads=2)


def test_defaults_are_no_tensor_parallelism() -> None:
    assert _parse([]) == TPSettings(num_threads=2)


def test_flags_and_environment() -> None:
    s = _parse(
        ["--tp", "4", "--tp-launcher", "ray", "--ray-strategy", "STRICT_SPREAD"],
        {"SPECSERVE_TP_TIMEOUT_S": "12.5", "RAY_ADDRESS": "auto", "SPECSERVE_TP_BACKEND": "gloo"},
    )
    assert (s.world_size, s.launcher, s.ray_strategy) == (4, "ray", "STRICT_SPREAD")
    assert (s.timeout_s, s.ray_address, s.backend) == (12.5, "auto", "gloo")


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"world_size": 0}, "--tp must be >= 1"),
        ({"launcher": "mpirun"}, "unknown TP launcher 'mpirun'"),
        ({"backend": "mpi"}, "unknown TP backend 'mpi'"),
        ({"timeout_s": 0.0}, "positive"),
        ({"ray_strategy": "ANY"}, "placement strategy"),
    ],
)
def test_bad_settings_are_refused(fields: dict, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        TPSettings(**fields)


def test_only_torchrun_ranks_above_zero_are_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    assert is_torchrun_worker(TPSettings(world_size=2))
    assert not is_torchrun_worker(TPSettings(world_size=2, launcher="ray"))
    assert not is_torchrun_worker(TPSettings(world_size=1))
    monkeypatch.setenv("RANK", "0")
    assert not is_torchrun_worker(TPSettings(world_size=2))
