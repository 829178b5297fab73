"""bench.kv_restore runs end to end against a tiny target served in this process.

A full run starts a target server process and a redis-server; here the target (a
tiny random model) is served in the test's own event loop and the chunks go to
fakeredis, standing in for ``run``'s two processes. Everything else is the
benchmark's own: ``main`` and its command line, the client that saves, restores and
re-prefills every context length, the compression check, the table and the plot.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import fakeredis
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import kv_restore
from bench.kv_restore_measure import Length, measure_target
from bench.kv_restore_report import plot
from specserve.orchestrator.snapshots.kv_chain import ChainParams
from specserve.orchestrator.snapshots.kv_store import ChunkStore
from specserve.serving.server import ServerOptions
from specserve.target_service.config import TargetServerConfig
from specserve.target_service.server import start

SERVING = health_pb2.HealthCheckResponse.SERVING


async def wait_serving(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(600):
            try:
                check = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if check.status == SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("the in-process target never served")


async def in_process_run(
    args: argparse.Namespace, redis_url: str
) -> tuple[list[Length], dict[str, Any]]:
    """``kv_restore.run`` with the target in this process and the chunks in fakeredis."""
    assert redis_url == "fake"
    params = ChainParams(args.chunk_tokens, args.max_call_mib << 20, timeout_s=60)
    options = ServerOptions(batch_window_ms=0)
    config = TargetServerConfig(model=args.model, kv_budget_bytes=8 << 20, server=options)
    running = await start(config)
    store = ChunkStore(fakeredis.FakeAsyncRedis(), ttl_s=3600, owned=True)
    try:
        await wait_serving(running.address)
        rows, comp, kv = await measure_target(
            running.address, store, params, args.lengths, args.tail, args.reps, args.warmup
        )
    finally:
        await store.close()
        await running.stop(0)
    return rows, kv_restore.describe(args, kv, params, "fakeredis", comp)


def test_the_command_line_keeps_its_defaults_and_refuses_an_empty_tail(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = kv_restore.parser().parse_args(["--lengths", "64,128"])
    assert args.lengths == [64, 128] and (args.chunk_tokens, args.tail) == (64, 1)
    assert (args.reps, args.warmup, args.name) == (5, 1, "kv_restore")
    with pytest.raises(SystemExit) as refused:
        kv_restore.main(["--tail", "0", "--no-write"])
    assert refused.value.code == 2
    assert "--tail must be >= 1" in capsys.readouterr().err


def test_a_tiny_run_restores_every_length_and_reports_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    measured: list[list[Length]] = []

    async def run(args: argparse.Namespace, redis_url: str) -> tuple[list[Length], Any]:
        rows, info = await in_process_run(args, redis_url)
        measured.append(rows)
        return rows, info

    monkeypatch.setattr(kv_restore, "run", run)
    monkeypatch.setattr(kv_restore, "write_results", None)  # --no-write: never called
    argv = ["--model", "tiny:3", "--lengths", "32,64", "--chunk-tokens", "16", "--reps", "2"]
    argv += ["--warmup", "0", "--redis-url", "fake", "--no-write"]
    assert kv_restore.main(argv) == 0

    [rows] = measured
    assert [(r.tokens, r.chunks) for r in rows] == [(32, 2), (64, 4)]
    for r in rows:
        assert r.chunk_bytes > 0 and r.same_token == [True, True]
        assert max(r.logp_diff) < 1e-3  # the restored cache computes the same next token
        assert all(len(s.times) == 2 for s in r.times.values())
        assert len(r.get_s.times) == len(r.import_s.times) == len(r.busy_restore_s.times) == 2
    out = capsys.readouterr().out
    assert "32 tokens: re-prefill " in out and "64 tokens: re-prefill " in out
    assert out.count("\n| 32 | 2 x 16 | ") == 1 and out.count("\n| 64 | 4 x 16 | ") == 1
    assert "Model `tiny:3` (float32)" in out and "chunks of 16 tokens" in out
    assert "Compression: zlib level 1 over the 64-token chunks" in out
    assert "Reproduce: `.venv/bin/python -m bench.kv_restore --model tiny:3" in out

    png = tmp_path / "kv_restore.png"
    assert plot(rows, png, "tiny:3 float32: resume a session (p50)") and png.stat().st_size > 0
