"""The HTTP layer's own cost per streamed token: ``/v1/completions`` SSE vs ``GenerateStream``.

One stack (:mod:`bench.http_stack`, tiny models by default) serves both paths: the
same request — a fixed token-id prompt, greedy, ``ignore_eos``, ``--tokens`` new
tokens, plain decoding (drafter none, so every gRPC message and every SSE event
carries exactly one token) — goes straight to the orchestrator's gRPC stream, and
through ``specserve http-server`` as a streamed completion. At each concurrency the
two paths alternate (gRPC, HTTP, HTTP, gRPC, ...) over ``--reps`` repetitions after
a warm-up. Figures:

* **added wall time per token**: (HTTP stream wall - gRPC stream wall) / tokens,
  median over repetitions (each repetition: the mean over its concurrent streams);
* **HTTP server CPU per token**: CPU seconds the http-server process used (utime +
  stime from /proc) over the tokens it streamed: its cost whatever the machine's
  other load;
* inter-token latency p50 of both paths (gaps between arriving tokens).

Clients: the gRPC one is ``grpc``'s sync stub, the HTTP one ``http.client`` reading
SSE lines, one thread per concurrent stream; client-side costs are in the walls.

    .venv/bin/python -m bench.experiments.http_overhead [--tokens 128] [--concurrency 1,8] \\
        [--reps 5]

Writes bench/results/http_overhead.{md,json}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from bench.common import environment, environment_md, reproduce_command, write_results
from bench.http_stack import MODEL_NAME, HttpStack, add_stack_arguments, http_stack
from specserve.client import request as grpc_request
from specserve.v1 import generate_pb2_grpc

PROMPT = [11, 45, 27, 11, 45, 27, 90, 3, 64, 11]
Stream = Callable[[], list[float]]  # one request; arrival time of each token


def grpc_stream(stub: generate_pb2_grpc.GenerationStub, tokens: int) -> Stream:
    req = grpc_request(PROMPT, max_new_tokens=tokens, drafter="none", ignore_eos=True)

    def run() -> list[float]:
        times = [time.perf_counter()]
        for m in stub.GenerateStream(req, timeout=600):
            now = time.perf_counter()
            times.extend([now] * len(m.token_ids))
        return times

    return run


def http_stream(host: str, port: int, tokens: int) -> Stream:
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "prompt": PROMPT,
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "speculation": {"drafter": "none"},
        }
    ).encode()

    def run() -> list[float]:
        conn = http.client.HTTPConnection(host, port, timeout=600)
        times = [time.perf_counter()]
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        for line in iter(r.readline, b""):
            if line.startswith(b'data: {"id"'):
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["text"]:
                    times.append(time.perf_counter())
        conn.close()
        return times

    return run


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_concurrent(stream: Stream, concurrency: int) -> list[list[float]]:
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda _: stream(), range(concurrency)))


def per_token_wall(runs: list[list[float]]) -> float:
    """Mean over streams of wall seconds per token."""
    return statistics.mean((t[-1] - t[0]) / (len(t) - 1) for t in runs)


def gaps(runs: list[list[float]]) -> list[float]:
    return [b - a for t in runs for a, b in itertools.pairwise(t[1:])]


def measure(s: HttpStack, args: argparse.Namespace) -> dict[str, Any]:
    channel = grpc.insecure_channel(s.orchestrator.address)
    stub = generate_pb2_grpc.GenerationStub(channel)
    paths = {
        "grpc": grpc_stream(stub, args.tokens),
        "http": http_stream(s.http.host, s.http.port, args.tokens),
    }
    pid = s.http.proc.pid if s.http.proc is not None else 0
    out: dict[str, Any] = {}
    for c in args.concurrency:
        for _ in range(args.warmup):
            for stream in paths.values():
                run_concurrent(stream, c)
        walls: dict[str, list[float]] = {"grpc": [], "http": []}
        itl: dict[str, list[float]] = {"grpc": [], "http": []}
        cpu = 0.0
        tokens = 0
        for rep in range(args.reps):
            order = ("grpc", "http") if rep % 2 == 0 else ("http", "grpc")
            for name in order:
                before = cpu_seconds(pid) if name == "http" else 0.0
                runs = run_concurrent(paths[name], c)
                if name == "http":
                    cpu += cpu_seconds(pid) - before
                    tokens += sum(len(t) - 1 for t in runs)
                assert all(len(t) - 1 == args.tokens for t in runs), [len(t) for t in runs]
                walls[name].append(per_token_wall(runs))
                itl[name].extend(gaps(runs))
        added = [h - g for g, h in zip(walls["grpc"], walls["http"], strict=True)]
        out[str(c)] = {
            "grpc_ms_per_token": 1e3 * statistics.median(walls["grpc"]),
            "http_ms_per_token": 1e3 * statistics.median(walls["http"]),
            "added_ms_per_token": 1e3 * statistics.median(added),
            "added_ms_per_token_reps": [1e3 * a for a in added],
            "http_server_cpu_ms_per_token": 1e3 * cpu / tokens,
            "itl_p50_ms": {k: 1e3 * statistics.median(v) for k, v in itl.items()},
        }
    channel.close()
    return out


def markdown(results: dict[str, Any], args: argparse.Namespace, env: dict[str, Any]) -> str:
    lines = [
        "# HTTP layer overhead per streamed token",
        "",
        f"`/v1/completions` (SSE, through `specserve http-server`) vs the orchestrator's "
        f"`GenerateStream`, same stack, {args.tokens} tokens per stream, plain decoding "
        f"(one token per message), models {args.target} / {args.draft}, "
        f"{args.reps} repetitions after {args.warmup} warm-up, paths alternated.",
        "",
        "| concurrent streams | gRPC ms/token | HTTP ms/token | **added ms/token** (p50) "
        "| http-server CPU ms/token | ITL p50 gRPC / HTTP ms |",
        "|---|---|---|---|---|---|",
    ]
    for c, r in results.items():
        lines.append(
            f"| {c} | {r['grpc_ms_per_token']:.3f} | {r['http_ms_per_token']:.3f} | "
            f"**{r['added_ms_per_token']:.3f}** | {r['http_server_cpu_ms_per_token']:.3f} | "
            f"{r['itl_p50_ms']['grpc']:.3f} / {r['itl_p50_ms']['http']:.3f} |"
        )
    lines += ["", "## Environment", "", environment_md(env), "", "## Reproduce", ""]
    lines += ["```", reproduce_command("bench.experiments.http_overhead"), "```"]
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.experiments.http_overhead", description=__doc__
    )
    add_stack_arguments(p)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int_list, default=[1, 8])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--name", default="http_overhead")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    env = environment()
    with http_stack(args) as s:
        results = measure(s, args)
    md = markdown(results, args, env)
    print(md)
    if not args.no_write:
        headline = {
            "added_ms_per_token": {
                c: round(r["added_ms_per_token"], 4) for c, r in results.items()
            },
            "http_server_cpu_ms_per_token": {
                c: round(r["http_server_cpu_ms_per_token"], 4) for c, r in results.items()
            },
        }
        data = {"headline": headline, "results": results, "args": vars(args), "environment": env}
        write_results(args.name, md, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
