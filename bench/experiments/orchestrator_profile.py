"""The orchestrator's own CPU per round, and where it goes (cProfile), at emulated device speed.

A tiny target and draft run as child processes whose every forward takes a fixed
device time while the CPU idles (:mod:`bench.emulated_device`, default draft
2 ms / target 12 ms), with a throwaway ``redis-server`` as the session store.
The orchestrator runs **in this process** (:func:`specserve.orchestrator.app.start`),
so its Python can be profiled; the clients run in a child process, so their
Python is not counted. For each ``--sessions`` count, that many greedy streams
(adaptive k, ``--drafter``, default the draft model) of ``--new-tokens`` run at
once, ``--reps`` times:

* unprofiled: the process's CPU time (every thread: the event loop, gRPC's
  threads) and the event loop thread's alone, each divided by the rounds the
  runner made, and the wall time per round;
* profiled (cProfile on the event loop thread, timed by that thread's CPU time, so
  a busy machine's waits are not counted): the functions with the most own CPU
  time per round.

It also reports the unprofiled runs' batch rounds by k cap and, at the end of each
sessions count, the planner's fitted round times (what the adaptive policy decides
from).

    .venv/bin/python -m bench.experiments.orchestrator_profile [--sessions 1,8] [--new-tokens 64] \\
        [--emulate-devices 2,12] [--reps 3] [--top 25] [--drafter model|none] [--k K] \\
        [--no-write]

Writes ``bench/results/orchestrator_profile.{md,json}`` (``--name`` changes the stem).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import cProfile
import io
import multiprocessing
import pstats
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.common import environment, environment_md, reproduce_command, write_results
from specserve.devtools.redis_server import throwaway_redis
from specserve.serving.launch import ServerProcess

TARGET = "tiny:3"
DRAFT = "tiny:3:noise=0.3"


def prompts(n: int, rep: int) -> list[list[int]]:
    return [[(31 * (rep * 64 + i) + j) % 250 + 1 for j in range(24)] for i in range(n)]


def run_clients(
    address: str, batch: list[list[int]], new_tokens: int, drafter: str, k: int | None
) -> int:
    """Child process: stream every prompt at once (``k`` None: adaptive); the tokens
    received."""
    from specserve.client import AsyncClient

    async def go() -> int:
        async with AsyncClient(address, timeout_s=600) as client:

            async def one(p: list[int]) -> int:
                got = 0
                deltas = client.stream(p, max_new_tokens=new_tokens, drafter=drafter, k=k)
                async for d in deltas:
                    got += len(d.token_ids)
                return got

            return sum(await asyncio.gather(*(one(p) for p in batch)))

    return asyncio.run(go())


async def measure(
    app: Any,
    pool: concurrent.futures.ProcessPoolExecutor,
    batch: list[list[int]],
    new_tokens: int,
    args: argparse.Namespace,
    profile: cProfile.Profile | None,
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    stats = app.runner.stats
    rounds0, caps0 = stats.rounds, collections.Counter(stats.k_caps)
    drafted0, accepted0 = stats.draft_tokens, stats.accepted_tokens
    cpu0, thread0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    tokens = await loop.run_in_executor(
        pool, run_clients, app.address, batch, new_tokens, args.drafter, args.k
    )
    if profile is not None:
        profile.disable()
    rounds = stats.rounds - rounds0
    return {
        "rounds": rounds,
        "tokens": tokens,
        "wall_s": time.perf_counter() - wall0,
        "process_cpu_s": time.process_time() - cpu0,
        "loop_cpu_s": time.thread_time() - thread0,
        "k_caps": dict(sorted((collections.Counter(stats.k_caps) - caps0).items())),
        "drafted": stats.draft_tokens - drafted0,
        "accepted": stats.accepted_tokens - accepted0,
    }


def top_functions(profile: cProfile.Profile, rounds: int, top: int) -> list[dict[str, Any]]:
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = []
    for (file, line, name), (_cc, calls, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if name in ("poll", "select") or "epoll" in name:
            continue  # the event loop idling
        where = file.split("site-packages/")[-1].split("specserve/")[-1]
        rows.append(
            {
                "function": f"{where}:{line}({name})",
                "calls_per_round": calls / rounds,
                "own_us_per_round": tt / rounds * 1e6,
                "cumulative_us_per_round": ct / rounds * 1e6,
            }
        )
    rows.sort(key=lambda r: -r["own_us_per_round"])
    return rows[:top]


async def run_all(args: argparse.Namespace, target: str, draft: str, redis_url: str) -> dict:
    from specserve.orchestrator import app as orchestrator_app
    from specserve.orchestrator import config

    parser = argparse.ArgumentParser()
    config.add_arguments(parser, {})
    argv = ["--target", target, "--draft", draft, "--redis-url", redis_url, "--port", "0"]
    app = await orchestrator_app.start(config.from_args(parser.parse_args(argv)))
    context = multiprocessing.get_context("spawn")
    out: dict[str, Any] = {}
    try:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
            warm = prompts(max(args.sessions), 99)
            await measure(app, pool, warm, 16, args, None)
            for n in args.sessions:
                plain = [
                    await measure(app, pool, prompts(n, rep), args.new_tokens, args, None)
                    for rep in range(args.reps)
                ]
                profile = cProfile.Profile(time.thread_time)  # CPU time: the machine is shared
                profiled = await measure(app, pool, prompts(n, 0), args.new_tokens, args, profile)
                rounds = sum(r["rounds"] for r in plain)
                caps: collections.Counter[int] = collections.Counter()
                for r in plain:
                    caps.update(r["k_caps"])
                fits = {t: app.runner.planner.fit(t) for t in app.runner.targets.replicas}
                out[str(n)] = {
                    "runs": plain,
                    "rounds": rounds,
                    "process_cpu_ms_per_round": sum(r["process_cpu_s"] for r in plain)
                    / rounds
                    * 1e3,
                    "loop_cpu_ms_per_round": sum(r["loop_cpu_s"] for r in plain) / rounds * 1e3,
                    "wall_ms_per_round": sum(r["wall_s"] for r in plain) / rounds * 1e3,
                    "profiled_rounds": profiled["rounds"],
                    "top": top_functions(profile, int(profiled["rounds"]), args.top),
                    "k_caps": dict(sorted(caps.items())),
                    "acceptance": sum(r["accepted"] for r in plain)
                    / max(1, sum(r["drafted"] for r in plain)),
                    "fit": {t: None if f is None else str(f) for t, f in fits.items()},
                }
                row = out[str(n)]
                print(
                    f"{n} sessions: {row['process_cpu_ms_per_round']:.2f} ms process CPU, "
                    f"{row['loop_cpu_ms_per_round']:.2f} ms loop CPU, "
                    f"{row['wall_ms_per_round']:.2f} ms wall per round ({rounds} rounds); "
                    f"rounds by k cap {row['k_caps']}, acceptance {row['acceptance']:.2f}; "
                    f"fit {row['fit']}",
                    flush=True,
                )
    finally:
        await app.close()
    return out


def headline(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """By sessions: the orchestrator's CPU and wall time per round, in ms."""
    keys = ("process_cpu_ms_per_round", "loop_cpu_ms_per_round", "wall_ms_per_round")
    return {n: {k: r[k] for k in keys} for n, r in results.items()}


def report(results: dict, args: argparse.Namespace, env: dict, argv: list[str]) -> str:
    draft_ms, target_ms = args.emulate_devices
    lines = [
        "# The orchestrator's CPU per round",
        "",
        f"Target `{args.target}`, draft `{args.draft}`, device time draft {draft_ms:g} ms / target "
        f"{target_ms:g} ms per forward, "
        f"real Redis, {args.new_tokens} tokens per stream, {args.reps} repetitions; greedy, "
        f"{'adaptive k' if args.k is None else f'k {args.k}'}, drafter {args.drafter}.",
        "",
        "| sessions | rounds | process CPU ms/round | event-loop CPU ms/round | wall ms/round "
        "| rounds by k cap | acceptance |",
        "| ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for n, r in results.items():
        caps = ", ".join(f"{cap}: {count}" for cap, count in r["k_caps"].items()) or "-"
        lines.append(
            f"| {n} | {r['rounds']} | {r['process_cpu_ms_per_round']:.2f} "
            f"| {r['loop_cpu_ms_per_round']:.2f} | {r['wall_ms_per_round']:.2f} | {caps} "
            f"| {r['acceptance']:.2f} |"
        )
    lines += ["", "The planner's fitted round times after each sessions count:", ""]
    for n, r in results.items():
        for target, fit in r["fit"].items():
            lines.append(f"- {n} sessions, target `{target}`: {fit or 'no fit yet'}")
    for n, r in results.items():
        lines += [
            "",
            f"## Own time per round, {n} sessions (cProfile, {r['profiled_rounds']} rounds)",
            "",
            "| function | calls/round | own µs/round | cumulative µs/round |",
            "| --- | ---: | ---: | ---: |",
        ]
        for t in r["top"]:
            lines.append(
                f"| `{t['function']}` | {t['calls_per_round']:.1f} "
                f"| {t['own_us_per_round']:.0f} | {t['cumulative_us_per_round']:.0f} |"
            )
    lines += ["", environment_md(env), "", f"Reproduce: `{reproduce_command(argv[0], argv[1:])}`"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.experiments.orchestrator_profile")
    p.add_argument("--sessions", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--emulate-devices",
        type=lambda t: tuple(float(x) for x in t.split(",")),
        default=(2.0, 12.0),
        help="DRAFT_MS,TARGET_MS of device time per forward",
    )
    p.add_argument("--top", type=int, default=25, help="functions listed per sessions count")
    p.add_argument("--drafter", choices=("model", "none"), default="model")
    p.add_argument("--target", default=TARGET, help="the target model (a tiny one)")
    p.add_argument("--draft", default=DRAFT, help="the draft model (noise sets its acceptance)")
    p.add_argument("--k", type=int, help="every request's own k (default: adaptive)")
    p.add_argument("--redis-url", help="an existing Redis (default: a throwaway redis-server)")
    p.add_argument("--name", default="orchestrator_profile")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    draft_ms, target_ms = args.emulate_devices
    common = ["--threads", "1", "--kv-budget", "64MiB"]
    servers = [
        ServerProcess(
            role, [role, "--forward-ms", str(ms), "--model", model, *common], module=module
        )
        for role, ms, model, module in (
            ("target", target_ms, args.target, "bench.emulated_device"),
            ("draft", draft_ms, args.draft, "bench.emulated_device"),
        )
    ]
    try:
        for s in servers:
            s.start(timeout_s=900)
        for s in servers:
            s.wait_serving(timeout_s=900)
        if args.redis_url:
            results = asyncio.run(
                run_all(args, servers[0].address, servers[1].address, args.redis_url)
            )
        else:
            with throwaway_redis() as url:
                results = asyncio.run(run_all(args, servers[0].address, servers[1].address, url))
    finally:
        for s in servers:
            s.stop()
    env = environment()
    md = report(results, args, env, ["bench.experiments.orchestrator_profile", *argv])
    print(md)
    if not args.no_write:
        data = {"headline": headline(results), "results": results}
        write_results(args.name, md, {**data, "environment": env, "argv": argv})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
