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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc.aio

from bench.common import (
    RESULTS_DIR,
    LoadProbe,
    Samples,
    environment,
    environment_md,
    reproduce_command,
    write_results,
)
from specserve.devtools.redis_server import RedisNotInstalled, throwaway_redis
from specserve.engine.kv_chunks import chain_keys
from specserve.orchestrator.fleet.replicas import channel_options
from specserve.orchestrator.snapshots.kv_chain import (
    ChainParams,
    TargetKv,
    restore_chain,
    save_chain,
    target_kv,
)
from specserve.orchestrator.snapshots.kv_store import ChunkStore
from specserve.orchestrator.store import keys
from specserve.orchestrator.store.redis_settings import RedisSettings
from specserve.serving.launch import ServerProcess
from specserve.v1 import common_pb2, target_pb2, target_pb2_grpc

NAME = "kv_restore"
MODULE = "bench.kv_restore"
VARIANTS = ("re-prefill", "restore", "save")


@dataclass
class Length:
    """Everything measured for one context length."""

    tokens: int
    chunks: int = 0  # whole chunks restored: (tokens - 1) // chunk_tokens
    chunk_bytes: int = 0  # serialized KvChunk bytes of all of them (what Redis holds)
    times: dict[str, Samples] = field(default_factory=lambda: {v: Samples() for v in VARIANTS})
    get_s: Samples = field(default_factory=Samples)  # restore: reading Redis
    import_s: Samples = field(default_factory=Samples)  # restore: ImportKv calls
    tail_s: Samples = field(default_factory=Samples)  # restore: the tail's Verify
    busy_prefill_s: Samples = field(default_factory=Samples)  # target model thread, re-prefill
    busy_restore_s: Samples = field(default_factory=Samples)  # ... ImportKv + tail forward
    same_token: list[bool] = field(default_factory=list)
    logp_diff: list[float] = field(default_factory=list)  # |log p restore - log p prefill|


@contextlib.contextmanager
def local_redis() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port (no persistence)."""
    try:
        with throwaway_redis() as url:
            yield url
    except RedisNotInstalled:
        raise SystemExit("redis-server is not installed; pass --redis-url") from None


def context_tokens(n: int) -> list[int]:
    """Deterministic ids below 256 (inside any vocabulary, the tiny models' too); the
    timings do not depend on the values."""
    return [(i * 7919 + 13) % 251 + 3 for i in range(n)]


class Bench:
    """The client side: one channel to the target, one chunk store."""

    def __init__(self, stub: target_pb2_grpc.TargetServiceStub, store: ChunkStore) -> None:
        self.stub = stub
        self.store = store

    async def prefill(self, sid: str, tokens: list[int]) -> tuple[float, Any]:
        session = target_pb2.PrefillSession(session_id=sid, tokens=tokens, return_logprobs=True)
        t0 = time.perf_counter()
        r = await self.stub.Prefill(target_pb2.PrefillRequest(sessions=[session]), timeout=600)
        return time.perf_counter() - t0, r

    async def release(self, sid: str) -> None:
        await self.stub.Release(common_pb2.ReleaseRequest(session_ids=[sid]), timeout=60)


async def measure(
    bench: Bench,
    kv: TargetKv,
    params: ChainParams,
    lengths: Sequence[int],
    tail: int,
    reps: int,
    warmup: int,
) -> list[Length]:
    c = params.chunk_tokens
    out = []
    for n in lengths:
        row = Length(n)
        tokens = context_tokens(n + tail)
        whole = (n + tail - 1) // c * c
        row.chunks = whole // c
        src = f"src-{n}"
        await bench.prefill(src, tokens)
        await save_chain(bench.store, bench.stub, src, tokens[:whole], kv, params)
        chunk_keys = chain_keys(kv.fingerprint, tokens[:whole], c)
        row.chunk_bytes = sum(len(v or b"") for v in await bench.store.get(chunk_keys))
        for rnd in range(warmup + reps):
            keep = rnd >= warmup
            # re-prefill
            sid = f"prefill-{n}-{rnd}"
            seconds, response = await bench.prefill(sid, tokens)
            want = response.results[0]
            if keep:
                row.times["re-prefill"].times.append(seconds)
                row.busy_prefill_s.times.append(response.compute_ns / 1e9)
            await bench.release(sid)
            # restore
            sid = f"restore-{n}-{rnd}"
            t0 = time.perf_counter()
            done = await restore_chain(bench.store, bench.stub, sid, tokens[:whole], kv, params)
            t1 = time.perf_counter()
            assert done.tokens == whole, f"restored {done.tokens} of {whole} tokens"
            session = target_pb2.VerifySession(
                session_id=sid,
                start=done.tokens,
                new_tokens=tokens[done.tokens :],
                return_logprobs=True,
            )
            request = target_pb2.VerifyRequest(sessions=[session], strict=True)
            verified = await bench.stub.Verify(request, timeout=600)
            t2 = time.perf_counter()
            got = verified.results[0]
            if keep:
                row.times["restore"].times.append(t2 - t0)
                row.get_s.times.append(done.get_ns / 1e9)
                row.import_s.times.append(done.import_ns / 1e9)
                row.tail_s.times.append(t2 - t1)
                row.busy_restore_s.times.append((done.target_ns + verified.compute_ns) / 1e9)
                row.same_token.append(got.next_token == want.next_token)
                row.logp_diff.append(abs(got.logprobs[0] - want.logprobs[0]))
            await bench.release(sid)
            # save (from the source session, with the chunks gone)
            await bench.store.redis.delete(*[keys.kv_key(k) for k in chunk_keys])
            t0 = time.perf_counter()
            await save_chain(bench.store, bench.stub, src, tokens[:whole], kv, params)
            if keep:
                row.times["save"].times.append(time.perf_counter() - t0)
        await bench.release(src)
        print(summary_line(row), flush=True)
        out.append(row)
    return out


async def compression(
    store: ChunkStore, kv: TargetKv, params: ChainParams, n: int
) -> dict[str, float]:
    """zlib level 1 over the stored chunks of the longest context: is it worth it?"""
    tokens = context_tokens(n)
    whole = n // params.chunk_tokens * params.chunk_tokens
    found = await store.get(chain_keys(kv.fingerprint, tokens[:whole], params.chunk_tokens))
    values = [v for v in found if v]
    if not values:
        return {}
    raw = sum(len(v) for v in values)
    t0 = time.perf_counter()
    packed = [zlib.compress(v, 1) for v in values]
    t1 = time.perf_counter()
    for p in packed:
        zlib.decompress(p)
    t2 = time.perf_counter()
    return {
        "bytes": raw,
        "ratio": raw / sum(len(p) for p in packed),
        "compress_mb_s": raw / (t1 - t0) / 1e6,
        "decompress_mb_s": raw / (t2 - t1) / 1e6,
    }


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def summary_line(row: Length) -> str:
    p, r = row.times["re-prefill"].median, row.times["restore"].median
    return (
        f"{row.tokens} tokens: re-prefill {p * 1e3:.1f} ms, restore {r * 1e3:.1f} ms "
        f"({p / r:.2f}x), save {row.times['save'].median * 1e3:.1f} ms"
    )


def table(rows: list[Length], c: int) -> str:
    head = (
        "| cached L | restored | in Redis | re-prefill p50 | restore p50 | re-prefill / restore "
        "| restore: Redis + ImportKv + tail | target busy: re-prefill / restore | save p50 "
        "| same next token |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = []
    for r in rows:
        p, s = r.times["re-prefill"].median, r.times["restore"].median
        lo, hi = r.times["restore"].spread
        same = f"{sum(r.same_token)}/{len(r.same_token)}"
        if r.logp_diff and max(r.logp_diff) > 0:
            same += f" (max Δ log p {max(r.logp_diff):.1e})"
        lines.append(
            f"| {r.tokens} | {r.chunks} x {c} | {r.chunk_bytes / 2**20:.1f} MiB "
            f"| {_ms(p)} | {_ms(s)} ({_ms(lo)}-{_ms(hi)}) | **{p / s:.2f}x** "
            f"| {_ms(r.get_s.median)} + {_ms(r.import_s.median)} + {_ms(r.tail_s.median)} "
            f"| {_ms(r.busy_prefill_s.median)} / {_ms(r.busy_restore_s.median)} "
            f"| {_ms(r.times['save'].median)} | {same} |"
        )
    return "\n".join([head, *lines])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def plot(rows: list[Length], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [r.tokens for r in rows]
    for name in VARIANTS:
        ax.plot(xs, [r.times[name].median * 1e3 for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("cached tokens L of the session")
    ax.set_ylabel("p50 ms")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(
    rows: list[Length],
    info: dict[str, Any],
    env: dict[str, Any],
    argv: Sequence[str],
    plotted: str | None,
) -> str:
    comp = info["compression"]
    comp_line = (
        f"zlib level 1 over the {info['lengths'][-1]}-token chunks: {comp['ratio']:.3f}x smaller "
        f"at {comp['compress_mb_s']:.0f} MB/s to compress and {comp['decompress_mb_s']:.0f} "
        "MB/s to decompress, so chunks are stored raw."
        if comp
        else "not measured"
    )
    return f"""# KV restore vs re-prefill

How fast a target replica resumes a session whose first L tokens were cached:
re-prefilling all L + {info["tail"]} committed tokens (one `Prefill`) against
restoring the L tokens' saved KV snapshot chunks (Redis reads + `ImportKv` over
loopback gRPC) and then verifying the {info["tail"]}-token tail (one `Verify`). One run,
variants interleaved round by round; p50 over {info["reps"]} rounds after
{info["warmup"]} warm-up round(s), quartiles of the restore in brackets. "Target
busy" is the time the target's model thread spent (the server's `compute_ns`):
during a re-prefill no other session on the replica makes progress. "Save" is
`ExportKv` + `SET` of every chunk (off the round's path in the orchestrator).

Model `{info["model"]}` ({info["dtype"]}), target server with {info["server_threads"]}
torch thread(s); chunks of {info["chunk_tokens"]} tokens, {info["kv_bytes_per_token"]}
K/V bytes per token; ImportKv / ExportKv calls of at most
{info["max_call_bytes"] >> 20} MiB; Redis {info["redis_version"]} on loopback.

{table(rows, info["chunk_tokens"])}

{plotted or ""}

Compression: {comp_line}

Reproduce: `{reproduce_command(MODULE, list(argv))}`

Environment:
{environment_md(env)}
- load average at the start: {env["load_average"]}; CPU share of processes other than
  this benchmark (client, target server, Redis) during the run: {info["others_cpu_share"]}
"""


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
        async with grpc.aio.insecure_channel(target.address, options=channel_options()) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            kv = await target_kv(stub, 60)
            if not kv.fingerprint:
                raise SystemExit("the target does not export KV (tensor-parallel?)")
            bench = Bench(stub, store)
            rows = await measure(bench, kv, params, args.lengths, args.tail, args.reps, args.warmup)
            comp = await compression(store, kv, params, args.lengths[-1])
        redis_version = (await redis.info("server")).get("redis_version", "unknown")
        for key in [k async for k in redis.scan_iter(match=keys.KV_PREFIX + "*")]:
            await redis.delete(key)
    await store.close()
    info = {
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
    return rows, info


def main(argv: Sequence[str] | None = None) -> int:
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
