"""KV restore vs re-prefill: how fast a target replica resumes a session with L cached tokens.

A target server runs as a child process on loopback and a Redis (a throwaway
``redis-server`` unless ``--redis-url``) holds the chunks. For every context
length L (256, 512, 1024, 2048 by default; multiples of the chunk size) a session
of L + ``--tail`` committed tokens is prefilled once, and the whole chunks of its
first L tokens are saved exactly as the orchestrator saves them
(:func:`~specserve.orchestrator.snapshots.kv_chain.save_chain`: ``ExportKv`` + ``SET``).
Then, repeatedly, with a fresh session id each time and the variants interleaved
(re-prefill, restore, save, re-prefill, ...):

* **re-prefill** — one ``Prefill`` of all L + tail tokens: what a target failover
  costs without snapshots;
* **restore** — :func:`~specserve.orchestrator.snapshots.kv_chain.restore_chain` (pipelined
  ``GETEX`` of the L / c chunks, ``ImportKv`` calls of at most 32 MiB over
  loopback gRPC), then a ``Verify`` of the tail tokens: what a failover costs with
  ``--kv-snapshots``. The default tail is 1 token, the last committed one, which
  a replayed round sends anyway; a failover between chunk boundaries (or while
  the export lags) has a longer tail, at most c - 1 more tokens plus the lag;
* **save** — the chunks deleted (untimed), then ``save_chain`` from the source
  session: what keeping the snapshot costs, off the round's path.

Both re-prefill and restore end with the session's cache holding L tokens and
its next token computed; the next token and its log p are compared. Figures are
medians over ``--reps`` rounds after ``--warmup``; the ratio is re-prefill /
restore in the same run. The client, Redis and the server share this machine's
cores, so the restore includes the client's protobuf work on the same CPUs.

Results go to ``bench/results/NAME.{md,json,png}`` (NAME = ``kv_restore``).
Run from the repository root (``--help`` for the knobs)::

    .venv/bin/python -m bench.kv_restore

This module starts the target server and Redis and runs the benchmark; the client
side that times the variants is :mod:`bench.kv_restore_measure`, the table, plot and
markdown are :mod:`bench.kv_restore_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from bench.common import RESULTS_DIR, LoadProbe, environment, write_results
from bench.kv_restore_measure import Length, measure_target
from bench.kv_restore_report import markdown, plot
from specserve.devtools.redis_server import RedisNotInstalled, throwaway_redis
from specserve.orchestrator.snapshots.kv_chain import ChainParams, TargetKv
from specserve.orchestrator.snapshots.kv_store import ChunkStore
from specserve.orchestrator.store import keys
from specserve.orchestrator.store.redis_settings import RedisSettings
from specserve.serving.launch import ServerProcess

NAME = "kv_restore"


@contextlib.contextmanager
def local_redis() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port (no persistence)."""
    try:
        with throwaway_redis() as url:
            yield url
    except RedisNotInstalled:
        raise SystemExit("redis-server is not installed; pass --redis-url") from None


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


async def run(args: argparse.Namespace, redis_url: str) -> tuple[list[Length], dict[str, Any]]:
    params = ChainParams(args.chunk_tokens, args.max_call_mib << 20, timeout_s=600)
    serving = ["--model", args.model, "--dtype", args.dtype, "--kv-budget", args.kv_budget]
    serving += ["--batch-window-ms", "0"]
    if args.threads:
        serving += ["--threads", str(args.threads)]
    redis = RedisSettings.from_url(redis_url, socket_timeout_s=120.0).client()
    store = ChunkStore(redis, ttl_s=3600, where=redis_url, owned=True)
    with ServerProcess("target", serving) as target:
        target.wait_serving(900)
        rows, comp, kv = await measure_target(
            target.address, store, params, args.lengths, args.tail, args.reps, args.warmup
        )
        redis_version = (await redis.info("server")).get("redis_version", "unknown")
        for key in [k async for k in redis.scan_iter(match=keys.KV_PREFIX + "*")]:
            await redis.delete(key)
    await store.close()
    return rows, describe(args, kv, params, redis_version, comp)


def describe(
    args: argparse.Namespace,
    kv: TargetKv,
    params: ChainParams,
    redis_version: str,
    comp: dict[str, float],
) -> dict[str, Any]:
    """The run's settings and what the target and Redis said, as the report reads them."""
    return {
        "model": args.model,
        "dtype": args.dtype,
        "server_threads": args.threads or "default",
        "chunk_tokens": args.chunk_tokens,
        "kv_bytes_per_token": kv.bytes_per_token,
        "max_call_bytes": params.max_call_bytes,
        "reps": args.reps,
        "warmup": args.warmup,
        "lengths": list(args.lengths),
        "tail": args.tail,
        "redis_version": redis_version,
        "compression": comp,
    }


def parser() -> argparse.ArgumentParser:
    """The command line (``--help``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="target model spec")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the target server")
    ap.add_argument(
        "--lengths",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[256, 512, 1024, 2048],
        help="comma-separated context lengths",
    )
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--tail", type=int, default=1, help="committed tokens after the L cached")
    ap.add_argument("--max-call-mib", type=int, default=32, help="chunk data per RPC")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--kv-budget", default="2GiB")
    ap.add_argument("--redis-url", help="an existing Redis (default: a throwaway redis-server)")
    ap.add_argument("--name", default=NAME, help="results file stem")
    ap.add_argument("--no-write", action="store_true", help="print, do not write results")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.tail < 1:
        ap.error("--tail must be >= 1: a verify needs at least one new token")
    argv = list(argv) if argv is not None else sys.argv[1:]
    env = environment()
    probe = LoadProbe()
    children, started = _children_cpu(), time.monotonic()
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(local_redis())
        rows, info = asyncio.run(run(args, url))
    # The target server and redis-server are this run's children (reaped by now): their
    # CPU time is the benchmark's own, not other processes'.
    share = probe.others_share()
    if share is not None:
        wall = (time.monotonic() - started) * (os.cpu_count() or 1)
        share = max(0.0, share - (_children_cpu() - children) / wall)
    info["others_cpu_share"] = f"{share:.0%}" if share is not None else "unknown"
    title = f"{args.model} {args.dtype}: resume a session (p50)"
    png = RESULTS_DIR / f"{args.name}.png"
    plotted = None
    if not args.no_write:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        plotted = f"![restore vs re-prefill]({png.name})" if plot(rows, png, title) else None
    md = markdown(rows, info, env, argv, plotted)
    print(md)
    if not args.no_write:
        data = {"environment": env, **info, "rows": rows}
        write_results(args.name, md, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
