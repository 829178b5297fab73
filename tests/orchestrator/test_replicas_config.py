"""Endpoint lists, DNS-resolved replica pools, passive health, and the config from flags."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import grpc
import grpc.aio
import pytest

from specserve.engine.errors import InvalidArgument
from specserve.orchestrator import config
from specserve.orchestrator.fleet.replicas import EndpointSpec, ReplicaPool
from specserve.orchestrator.fleet.scheduler import SchedulerConfig
from specserve.orchestrator.round import calls
from specserve.orchestrator.round.calls import RoundTimeouts
from specserve.serving.replica_connection import ReplicaConnection
from specserve.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.orchestrator.test_slow_replicas import live


def test_endpoint_lists() -> None:
    spec = EndpointSpec.parse("a:1, b:2,a:1,dns:///svc.ns:50052", "target")
    assert spec.static == ("a:1", "b:2")
    assert spec.dns == (("svc.ns", 50052),)
    assert not EndpointSpec.parse("", "draft")
    for bad in ("a", "a:b", ":1", "dns:///x", "a:70000"):
        with pytest.raises(InvalidArgument, match="host:port"):
            EndpointSpec.parse(bad, "draft")


def test_dns_names_resolve_to_one_replica_per_address() -> None:
    async def body() -> None:
        pool = ReplicaPool(
            "target", EndpointSpec.parse("dns:///localhost:7001", "t"), lambda ch: ch
        )
        changes = []
        pool.on_change = lambda: changes.append(1)
        await pool.start()
        assert "127.0.0.1:7001" in pool.endpoints()
        assert changes
        await pool.refresh()  # same answer: nothing changes
        assert len(changes) == 1
        await pool.close()

    asyncio.run(body())


def test_failed_replicas_back_off_and_come_back() -> None:
    now = [100.0]

    async def body() -> None:
        pool = ReplicaPool(
            "draft",
            EndpointSpec.parse("a:1,b:2", "d"),
            lambda ch: ch,
            backoff_s=1,
            clock=lambda: now[0],
        )
        await pool.start()
        assert pool.usable() == ["a:1", "b:2"]
        pool.mark_failed("a:1", "test")
        assert pool.usable() == ["b:2"]
        now[0] += 1.5
        assert pool.usable() == ["a:1", "b:2"]  # tried again after the backoff
        pool.mark_failed("a:1", "again")
        now[0] += 1.5
        assert pool.usable() == ["b:2"]  # the backoff doubled
        pool.mark_ok("a:1", "replica-a")
        assert pool.usable() == ["a:1", "b:2"]
        replica = pool.get("a:1")
        assert replica is not None and replica.replica_id == "replica-a"
        await pool.close()

    asyncio.run(body())


def test_config_from_flags_and_environment() -> None:
    parser = argparse.ArgumentParser()
    env = {
        "SPECSERVE_TARGET_ENDPOINTS": "t:1,t:2",
        "SPECSERVE_REDIS_URL": "rediss://:pw@cache:6380/1",
        "SPECSERVE_K_ZERO_AT": "16",
    }
    config.add_arguments(parser, env)
    cfg = config.from_args(parser.parse_args(["--draft", "d:1", "--redis-password", "secret"]))
    assert cfg.targets.static == ("t:1", "t:2") and cfg.drafts.static == ("d:1",)
    assert cfg.redis is not None and cfg.redis.tls and cfg.redis.password == "secret"
    assert cfg.policy.curve_zero_at == 16 and cfg.policy.curve_cap(16) == 0
    assert cfg.server.port == config.DEFAULT_PORT
    with pytest.raises(SystemExit):  # no target anywhere
        config.add_arguments(bare := argparse.ArgumentParser(), {})
        bare.parse_args([])


def test_kv_snapshot_flags() -> None:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, {"SPECSERVE_TARGET_ENDPOINTS": "t:1"})
    off = config.from_args(parser.parse_args([]))
    assert not off.snapshots.enabled and off.snapshot_redis is None
    args = ["--kv-snapshots", "--kv-snapshot-chunk-tokens", "32", "--kv-snapshot-every", "2"]
    args += ["--kv-snapshot-ttl-s", "120", "--kv-snapshot-redis-url", "redis://kv:6390/2"]
    on = config.from_args(parser.parse_args(args))
    assert on.snapshots.enabled and on.snapshots.chunk_tokens == 32
    assert (on.snapshots.every_chunks, on.snapshots.ttl_s) == (2, 120.0)
    assert on.snapshot_redis is not None and on.snapshot_redis.port == 6390
    env = {"SPECSERVE_TARGET_ENDPOINTS": "t:1", "SPECSERVE_KV_SNAPSHOTS": "true"}
    config.add_arguments(from_env := argparse.ArgumentParser(), env)
    assert config.from_args(from_env.parse_args([])).snapshots.enabled
    with pytest.raises(InvalidArgument, match=r"chunk_tokens must be in 1\.\.4096"):
        config.from_args(parser.parse_args(["--kv-snapshot-chunk-tokens", "0"]))


def test_max_prefill_tokens_flag() -> None:
    def parse(env: dict[str, str], argv: list[str]) -> int:
        parser = argparse.ArgumentParser()
        config.add_arguments(parser, {"SPECSERVE_TARGET_ENDPOINTS": "t:1", **env})
        return config.from_args(parser.parse_args(argv)).scheduler.max_prefill_tokens

    assert parse({}, []) == SchedulerConfig().max_prefill_tokens == 512
    assert parse({"SPECSERVE_MAX_PREFILL_TOKENS": "2048"}, []) == 2048
    assert parse({"SPECSERVE_MAX_PREFILL_TOKENS": "2048"}, ["--max-prefill-tokens", "64"]) == 64
    with pytest.raises(InvalidArgument, match="max_prefill_tokens must be >= 1"):
        parse({}, ["--max-prefill-tokens", "0"])


def test_round_timeouts_come_from_their_own_flags() -> None:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, {"SPECSERVE_TARGET_ENDPOINTS": "t:1"})
    argv = ["--draft-timeout-s", "1.5", "--target-timeout-s", "600", "--failover-s", "7"]
    t = config.from_args(parser.parse_args(argv)).timeouts
    assert (t.draft_s, t.target_s, t.failover_s) == (1.5, 600.0, 7.0)
    assert t.draft_warm_s == RoundTimeouts().draft_warm_s  # no flag: the default


def test_the_round_transport_is_not_a_choice() -> None:
    """Rounds always go over the replicas' data-plane sockets: the old flag is refused,
    not ignored, so a deployment that still passes it hears of it."""
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, {"SPECSERVE_TARGET_ENDPOINTS": "t:1"})
    with pytest.raises(SystemExit):
        parser.parse_args(["--round-transport", "stream"])


def test_a_stream_pool_opens_one_stream_per_replica_lazily() -> None:
    async def body() -> None:
        pool = ReplicaPool(
            "draft",
            EndpointSpec.parse("127.0.0.1:1,127.0.0.1:2", "draft"),
            draft_pb2_grpc.DraftServiceStub,
            connection_factory=ReplicaConnection.propose,
        )
        await pool.start()
        streams = [pool.replicas[ep].connection for ep in pool.endpoints()]
        assert all(isinstance(s, ReplicaConnection) for s in streams)
        assert [s.opened for s in streams if s is not None] == [0, 0]  # none opened yet
        await pool.close()
        unary = ReplicaPool(
            "draft", EndpointSpec.parse("127.0.0.1:1", "draft"), draft_pb2_grpc.DraftServiceStub
        )
        await unary.start()
        assert unary.replicas["127.0.0.1:1"].connection is None
        await unary.close()

    asyncio.run(body())


class NoDataPort(target_pb2_grpc.TargetServiceServicer):
    """A target that serves gRPC but reports no data port (``--data-port off``)."""

    async def GetLoad(self, request: Any, context: Any) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(role="target", data_port=0)


def test_a_target_without_a_data_port_is_lost_for_its_rounds_naming_the_port(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The orchestrator's pools send rounds over the data-plane socket only: a replica
    that has none fails the Verify UNAVAILABLE at once (no hang, no other transport), is
    taken out of the pool, and both the error and the log say why."""

    async def body() -> calls.VerifyOutcome:
        server = grpc.aio.server()
        target_pb2_grpc.add_TargetServiceServicer_to_server(NoDataPort(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        endpoint = f"127.0.0.1:{port}"
        pool = ReplicaPool(
            "target",
            EndpointSpec.parse(endpoint, "target"),
            target_pb2_grpc.TargetServiceStub,
            connection_factory=ReplicaConnection.verify,
        )
        await pool.start()
        try:
            items = [(live("no-port", [1, 2, 3]), calls.Plan())]
            out = await asyncio.wait_for(calls.verify(pool, endpoint, items, 30.0), 10)
            assert pool.usable() == []  # down for its backoff
            return out
        finally:
            await pool.close()
            await server.stop(0)

    out = asyncio.run(body())
    assert out.lost and not out.verdicts
    assert "UNAVAILABLE" in out.why and "reports no data port" in out.why
    assert "--data-port" in caplog.text and "is down for" in caplog.text
