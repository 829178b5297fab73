"""RPC overhead of a speculative round: time outside model compute, per batch size.

A draft and a target server run as separate processes on loopback; the round
client (:class:`bench.round_client.RoundClient`) drives batches of 1,
8 and 32 sessions with k = 4, sampled drafting (every draft position carries a
sparse q of 64 entries) and a 150k vocabulary. For every RPC the overhead is

    client wall time of the call - compute_ns reported by the server,

i.e. serialisation, transport, deserialisation, validation, conversion and the
hop to the model thread and back. A round's overhead is that of its Propose plus
its Verify. Batch sizes are interleaved round by round (1, 8, 32, 1, 8, 32, ...)
so the noise of a shared machine falls on all alike; an empty unary RPC
(GetLoad) is timed in the same loop as the floor of the transport, and so is a
``Check`` on a bare grpc.aio health server (:mod:`bench.bare_grpc`: no interceptors,
no specserve code), the floor of Python gRPC itself.

Two server variants (``--models``):

* ``stub`` (the headline): the real servers with stub backends
  (:mod:`bench.rpc_stub`) — no model work, so the CPU is all the RPC path's, as
  on a GPU replica whose CPU waits while the device computes;
* ``tiny``: the tiny random decoder with its vocabulary widened to 150,000
  (``tiny:3:vocab=150000``, draft a noisy copy): real compute of tens to hundreds
  of ms per call on the same cores as the transport.

Servers run with ``--batch-window-ms 0``: the coalescing window (2 ms by default)
is a deliberate wait for other callers, not serialisation or transport.

    .venv/bin/python -m bench.rpc_overhead [--rounds 300] [--models stub,tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import environment, environment_md, reproduce_command, write_results
from bench.round_client import RoundClient, RpcTiming
from bench.rpc_stub import handler_cost
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.k_policy import KPolicy
from specserve.engine.sampling import SamplingParams
from specserve.serving.launch import ServerProcess
from specserve.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

VOCAB = 150_000
K = 4
SUPPORT = 64
BATCHES = (1, 8, 32)
TARGET_P50_MS = 1.0  # for a batch of 8


@dataclass
class Series:
    """Per-round samples (ns) for one batch size."""

    round_ns: list[int] = field(default_factory=list)
    propose_ns: list[int] = field(default_factory=list)
    verify_ns: list[int] = field(default_factory=list)
    compute_ns: list[int] = field(default_factory=list)
    propose_bytes: list[int] = field(default_factory=list)  # request + response
    verify_bytes: list[int] = field(default_factory=list)

    def add(self, calls: Sequence[RpcTiming]) -> None:
        propose = [c for c in calls if c.method == "Propose"]
        verify = [c for c in calls if c.method == "Verify"]
        assert len(propose) == len(verify) == 1, [c.method for c in calls]  # nothing went stale
        p, v = propose[0], verify[0]
        self.propose_ns.append(p.overhead_ns)
        self.verify_ns.append(v.overhead_ns)
        self.round_ns.append(p.overhead_ns + v.overhead_ns)
        self.compute_ns.append(p.compute_ns + v.compute_ns)
        self.propose_bytes.append(p.request_bytes + p.response_bytes)
        self.verify_bytes.append(v.request_bytes + v.response_bytes)


def pct(values: list[int], q: float) -> float:
    """The q-quantile in milliseconds (inclusive method)."""
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return (cuts[int(q * 100) - 1] if q < 1 else max(values)) / 1e6


def sessions(batch: int, seed: int) -> list[DecodeState]:
    params = SamplingParams(temperature=1.0, seed=seed)
    return [
        DecodeState(
            f"b{batch}-{i}",
            [(seed * 7919 + i * 104729 + j * 31) % VOCAB for j in range(16)],
            params,
            StopCriteria(max_new_tokens=100_000),
            KPolicy(K),
        )
        for i in range(batch)
    ]


async def measure(
    target: str, draft: str, bare: str, rounds: int, warmup: int
) -> tuple[dict[int, Series], dict[str, list[int]]]:
    """Per-batch round series, and three reference RPCs timed in the same loop (ns):
    ``bare`` = health Check on a bare grpc.aio server, ``empty`` = GetLoad (no model
    thread), ``hop`` = Release of an unknown session (a round trip through the model
    thread, no model work)."""
    out = {b: Series() for b in BATCHES}
    floor: dict[str, list[int]] = {"bare": [], "empty": [], "hop": []}
    async with (
        grpc.aio.insecure_channel(target) as tc,
        grpc.aio.insecure_channel(draft) as dc,
        grpc.aio.insecure_channel(bare) as bc,
    ):
        calls: list[RpcTiming] = []
        client = RoundClient(
            target_pb2_grpc.TargetServiceStub(tc),
            draft_pb2_grpc.DraftServiceStub(dc),
            on_rpc=calls.append,
        )
        batches = {b: sessions(b, seed=b) for b in BATCHES}
        stub = target_pb2_grpc.TargetServiceStub(tc)
        health = health_pb2_grpc.HealthStub(bc)
        references = {
            "bare": lambda: health.Check(health_pb2.HealthCheckRequest()),
            "empty": lambda: stub.GetLoad(common_pb2.GetLoadRequest()),
            "hop": lambda: stub.Release(common_pb2.ReleaseRequest(session_ids=["none"])),
        }
        for r in range(warmup + rounds):
            for name, call in references.items():
                t0 = time.perf_counter_ns()
                await call()
                if r >= warmup:
                    floor[name].append(time.perf_counter_ns() - t0)
            for b in BATCHES:
                calls.clear()
                await client.round(batches[b])
                if r >= warmup:
                    out[b].add(calls)
        for states in batches.values():
            await client.release(states)
    return out, floor


def summarize(series: dict[int, Series]) -> list[dict[str, Any]]:
    rows = []
    for b, s in series.items():
        rows.append(
            {
                "batch": b,
                "rounds": len(s.round_ns),
                "round_p50_ms": pct(s.round_ns, 0.5),
                "round_p99_ms": pct(s.round_ns, 0.99),
                "propose_p50_ms": pct(s.propose_ns, 0.5),
                "propose_p99_ms": pct(s.propose_ns, 0.99),
                "verify_p50_ms": pct(s.verify_ns, 0.5),
                "verify_p99_ms": pct(s.verify_ns, 0.99),
                "compute_p50_ms": pct(s.compute_ns, 0.5),
                "propose_kib": statistics.median(s.propose_bytes) / 1024,
                "verify_kib": statistics.median(s.verify_bytes) / 1024,
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| sessions | round p50 | round p99 | Propose p50 / p99 | Verify p50 / p99 "
        "| compute p50 | Propose msgs | Verify msgs |\n|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [
        f"| {r['batch']} | **{r['round_p50_ms']:.3f}** | {r['round_p99_ms']:.3f} "
        f"| {r['propose_p50_ms']:.3f} / {r['propose_p99_ms']:.3f} "
        f"| {r['verify_p50_ms']:.3f} / {r['verify_p99_ms']:.3f} | {r['compute_p50_ms']:.2f} "
        f"| {r['propose_kib']:.1f} KiB | {r['verify_kib']:.1f} KiB |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def section(name: str, result: dict[str, Any]) -> str:
    rows, floor = result["rows"], result["reference_rpc_ns"]
    eight = next(r for r in rows if r["batch"] == 8)
    verdict = "meets" if eight["round_p50_ms"] <= TARGET_P50_MS else "misses"
    return f"""## {TITLES[name]}

{result["rounds"]} rounds per batch size after {result["warmup"]} warm-up rounds.

{table(rows)}

References timed in the same loop: a health `Check` on a bare grpc.aio server
(no interceptors, no specserve code: Python gRPC's own floor)
{pct(floor["bare"], 0.5):.3f} ms p50 / {pct(floor["bare"], 0.99):.3f} ms p99; an empty
unary RPC of ours (`GetLoad`, answered on the event loop)
{pct(floor["empty"], 0.5):.3f} ms p50 / {pct(floor["empty"], 0.99):.3f} ms p99;
a round trip through the model thread with no work (`Release` of an unknown id)
{pct(floor["hop"], 0.5):.3f} ms p50 / {pct(floor["hop"], 0.99):.3f} ms p99. A round's two
RPCs therefore cost at least about {2 * pct(floor["hop"], 0.5):.3f} ms on this machine
before a byte of session data is handled, and two calls to the bare server
{2 * pct(floor["bare"], 0.5):.3f} ms. Batch of 8: round overhead p50
{eight["round_p50_ms"]:.3f} ms, which **{verdict}** the target of <= {TARGET_P50_MS:.0f} ms.
"""


def handling_section(cost: dict[str, list[float]]) -> str:
    rows = "\n".join(
        f"| {b} | {p:.3f} | {v:.3f} | {p + v:.3f} |"
        for b, p, v in zip(BATCHES, cost["propose"], cost["verify"], strict=True)
    )
    return f"""## Server-side handling alone, in one process (no transport)

What our code costs per call on the server: parse the request, validate and convert,
the round trip through the model thread, build and serialise the response (stub
backends, compute subtracted). p50 in ms:

| sessions | Propose | Verify | round |
|---:|---:|---:|---:|
{rows}
"""


def markdown(
    results: dict[str, dict[str, Any]],
    cost: dict[str, list[float]],
    env: dict[str, Any],
    argv: list[str],
) -> str:
    sections = "\n".join(section(name, r) for name, r in results.items())
    sections += "\n" + handling_section(cost)
    return f"""# RPC overhead of a speculative round

Per round, time spent outside model compute: for each RPC the client's wall time
minus the `compute_ns` the server reports, summed over the round's `Propose` and
`Verify`. Milliseconds, p50 / p99, one run, batch sizes interleaved round by round.

Setup: draft and target servers as separate processes on loopback, driven by
`RoundClient` (`bench/round_client.py`: the orchestrator's Propose and Verify
messages); k = {K}, sampled drafting, so each draft position carries a sparse q of
{SUPPORT} ids + probabilities (`SparseQ`, packed little-endian); vocabulary {VOCAB:,};
servers with `--batch-window-ms 0 --threads 1` (the coalescing window, 2 ms by default, is a
deliberate wait for other callers and would add up to its length to a lone
call). "Msgs" is request + response size per RPC.

{sections}
Reproduce: `{reproduce_command("bench.rpc_overhead", argv)}`

Environment:
{environment_md(env)}
- load average at the start: {env["load_average"]} (a shared machine: other jobs ran
  alongside; every wake-up of a server or client thread can wait for a core)
"""


TITLES = {
    "stub": "Stub backends: the RPC path alone (headline)",
    "tiny": "Tiny random models with a 150k vocabulary: real compute on the same cores",
}


def servers(name: str, threads: int) -> tuple[ServerProcess, ServerProcess]:
    serving = ["--threads", str(threads), "--batch-window-ms", "0"]
    if name == "stub":
        return (
            ServerProcess("target", ["target", *serving], module="bench.rpc_stub"),
            ServerProcess("draft", ["draft", *serving], module="bench.rpc_stub"),
        )
    serving += ["--kv-budget", "512MiB"]
    return (
        ServerProcess("target", ["--model", f"tiny:3:vocab={VOCAB}", *serving]),
        ServerProcess(
            "draft",
            ["--model", f"tiny:3:noise=0.3:vocab={VOCAB}", "--max-support", str(SUPPORT), *serving],
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300, help="measured rounds per batch size")
    parser.add_argument("--tiny-rounds", type=int, default=60, help="rounds for the tiny models")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--models", default="stub,tiny", help="comma-separated: stub, tiny")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per server")
    parser.add_argument("--no-write", action="store_true", help="print, do not write results")
    args = parser.parse_args(argv)
    env = environment()
    results: dict[str, dict[str, Any]] = {}
    for name in args.models.split(","):
        rounds = args.rounds if name == "stub" else args.tiny_rounds
        target, draft = servers(name, args.threads)
        bare = ServerProcess("bare", [], module="bench.bare_grpc")
        with target, draft, bare:
            target.wait_serving(120)
            draft.wait_serving(120)
            bare.wait_serving(30)
            series, floor = asyncio.run(
                measure(target.address, draft.address, bare.address, rounds, args.warmup)
            )
        results[name] = {
            "rounds": rounds,
            "warmup": args.warmup,
            "rows": summarize(series),
            "reference_rpc_ns": floor,
            "samples_ns": {b: s.__dict__ for b, s in series.items()},
        }
    cost = asyncio.run(handler_cost(BATCHES, args.rounds))
    md = markdown(results, cost, env, list(argv) if argv is not None else sys.argv[1:])
    print(md)
    if not args.no_write:
        data = {
            "environment": env,
            "k": K,
            "support": SUPPORT,
            "vocab": VOCAB,
            **results,
            "server_handling_p50_ms": cost,
        }
        write_results("rpc_overhead", md, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
