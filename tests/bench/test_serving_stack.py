"""bench.serving_stack: each orchestrator's session store and declared devices."""

from __future__ import annotations

import argparse

import pytest

from bench.serving_stack import OrchestratorSetting, orchestrator_env, serving_stack


def test_each_orchestrator_gets_its_own_redis_database_unless_its_setting_names_one() -> None:
    args = argparse.Namespace(emulate_devices=(2.0, 12.0))
    url = "redis://127.0.0.1:6380/0"
    first = orchestrator_env(args, OrchestratorSetting(), url, 0)
    second = orchestrator_env(args, OrchestratorSetting(), url, 3)
    assert first["SPECSERVE_REDIS_URL"] == "redis://127.0.0.1:6380/0"
    assert second["SPECSERVE_REDIS_URL"] == "redis://127.0.0.1:6380/3"
    assert first["SPECSERVE_DEVICES"] == "separate"
    own = OrchestratorSetting(env={"SPECSERVE_REDIS_URL": "redis://elsewhere:6379/5"})
    assert orchestrator_env(args, own, url, 1)["SPECSERVE_REDIS_URL"] == "redis://elsewhere:6379/5"


def test_the_embedded_store_sets_no_redis_url() -> None:
    args = argparse.Namespace(emulate_devices=None)
    env = orchestrator_env(args, OrchestratorSetting(), None, 0)
    assert "SPECSERVE_REDIS_URL" not in env
    assert env["SPECSERVE_DEVICES"] == "shared"


def test_an_unknown_store_is_refused_before_anything_starts() -> None:
    args = argparse.Namespace(store="memcached", threads=1, target="tiny:1", draft="tiny:1")
    args.target_dtype = args.draft_dtype = "float32"
    args.emulate_devices = None
    stack = serving_stack(args, {"a": OrchestratorSetting()})
    with pytest.raises(ValueError, match="store must be one of embedded, redis"), stack:
        pass
