"""RPC overhead of a speculative round: time outside model compute, per batch size.

A draft and a target server run as separate processes on loopback; the round
client (:class:`bench.round_client.RoundClient`) drives batches of 8 and 32
sessions with k = 4, sampled drafting (every draft position carries a sparse q
of 64 entries) and a 150k vocabulary. For every RPC the overhead is

    client wall time of the call - compute_ns reported by the server,

i.e. serialisation, transport, deserialisation, validation, conversion and the
hop to the model thread and back. A round's overhead is that of its Propose plus
its Verify. The round runs over both transports this code has
(:mod:`bench.round_transport`: one connection to each replica's data-plane socket,
the orchestrator's one transport and the headline; unary calls, what other clients
use). The gRPC bidirectional stream is measured only as a bare floor. Batch sizes
and transports are interleaved round by round so the noise of a shared machine
falls on all alike, and so are the references:

* the same round's two messages, byte for byte, echoed by a bare grpc.aio server
  (:mod:`bench.bare_grpc`: no interceptors, no specserve code) as two unary calls,
  as one message on each of two open bidirectional streams, and as one frame on
  each of two connections to a plain TCP echo beside it: the floor each transport
  sets;
* a health ``Check`` on that server, an empty unary RPC of ours (GetLoad) and a
  round trip through the model thread (Release of an unknown id).

Two server variants (``--models``):

* ``stub`` (the headline): the real servers with stub backends
  (:mod:`bench.rpc_stub`) — no model work, so the CPU is all the RPC path's, as
  on a GPU replica whose CPU waits while the device computes;
* ``tiny``: the tiny random decoder with its vocabulary widened to 150,000
  (``tiny:3:vocab=150000``, draft a noisy copy): real compute of tens to hundreds
  of ms per call on the same cores as the transport.

Servers run with ``--batch-window-ms 0``: the coalescing window (2 ms by default)
is a deliberate wait for other callers, not serialisation or transport. A second pair
of stub servers can be driven in the same loop: another checkout's (``--baseline``,
an ablation) or this one's with every request's conversion memoized (``--floor``:
what the framework, the transport and the hop cost with validation at ~0).

    .venv/bin/python -m bench.rpc_overhead [--rounds 300] [--models stub,tiny] [--floor]

Writes ``bench/results/rpc_overhead.{md,json}``; the JSON's ``headline`` has
``round_overhead_p50_ms`` (and p90) keyed by batch size (``"8"``, ``"32"``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import rpc_overhead_report as report
from bench.bare_grpc import BARE, EchoClient, bare_round
from bench.common import environment, write_results
from bench.round_client import RoundClient, RpcTiming
from bench.round_transport import (
    TRANSPORTS,
    close_stubs,
    orchestrator_transport,
    round_stubs,
    unavailable,
)
from bench.rpc_stub import handler_cost
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.sampling import SamplingParams
from specserve.policy.k_policy import KPolicy
from specserve.serving.launch import ServerProcess
from specserve.v1 import common_pb2, target_pb2_grpc

VOCAB = 150_000
K = 4
SUPPORT = 64
BATCHES = (8, 32)
START_TIMEOUT_S = 600.0  # to bind, then to serve: a shared machine can take minutes
TITLES = {
    "stub": "Stub backends: the RPC path alone (headline)",
    "tiny": "Tiny random models with a 150k vocabulary: real compute on the same cores",
}


@dataclass
class Series:
    """Per-round samples (ns) for one batch size over one transport."""

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


# (request bytes, response bytes) of a round's Propose, then of its Verify.
RoundSizes = tuple[tuple[int, int], tuple[int, int]]


def round_sizes(calls: Sequence[RpcTiming]) -> RoundSizes:
    """The message sizes of the round whose calls these are (its last Propose and Verify)."""
    p = [c for c in calls if c.method == "Propose"][-1]
    v = [c for c in calls if c.method == "Verify"][-1]
    return (p.request_bytes, p.response_bytes), (v.request_bytes, v.response_bytes)


def sessions(name: str, batch: int, seed: int) -> list[DecodeState]:
    """``batch`` sampled sessions ``NAME-0`` .. of a 16-token prompt each, at fixed k."""
    params = SamplingParams(temperature=1.0, seed=seed)
    return [
        DecodeState(
            f"{name}-{i}",
            [(seed * 7919 + i * 104729 + j * 31) % VOCAB for j in range(16)],
            params,
            StopCriteria(max_new_tokens=100_000),
            KPolicy(K),
        )
        for i in range(batch)
    ]


def revision(tree: str) -> str:
    """The commit a checkout is at (what the results name instead of its path)."""
    out = subprocess.run(
        ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "an unknown revision"


async def _timed(call: Callable[[], Awaitable[object]]) -> int:
    t0 = time.perf_counter_ns()
    await call()
    return time.perf_counter_ns() - t0


BASELINE = ", baseline"  # the label suffix of --baseline's servers' rounds
FLOOR = ", floor"  # the label suffix of --floor's servers' rounds
AFTER_IDLE = ", after idle"  # the label suffix of the rounds after --idle-ms asleep


async def measure(
    target: str,
    draft: str,
    bare: str,
    transports: Sequence[str],
    rounds: int,
    warmup: int,
    baseline: tuple[str, str] | None = None,
    idle: tuple[str, float] | None = None,
    second: str = BASELINE,
) -> tuple[dict[tuple[str, int], Series], dict[str, list[int]], dict[str, dict[int, list[int]]]]:
    """Per-(transport, batch) round series; three single-call references (ns): ``bare`` =
    health Check on a bare grpc.aio server, ``empty`` = GetLoad (no model thread), ``hop``
    = Release of an unknown session (a round trip through the model thread, no model
    work); and per batch the bare unary and stream rounds of the same bytes (ns).
    ``baseline``: (target, draft) servers of another checkout, driven the same way in
    the same loop, each transport labelled ``"<transport>, baseline"`` (an ablation:
    ratios in one run, both pairs under the same traffic); ``second`` is the label suffix
    of that pair (:data:`FLOOR` for ``--floor``'s servers). ``idle``: (transport, seconds):
    also rounds over that transport after the client slept that long, labelled
    ``"<transport>, after idle"`` (every process idle meanwhile, as while a device
    computes), and the bare socket echo's round after the same sleep."""
    labels = list(transports)
    if baseline is not None:
        labels += [t + second for t in transports]
    if idle is not None:
        labels.append(idle[0] + AFTER_IDLE)
        if baseline is not None:
            labels.append(idle[0] + second + AFTER_IDLE)
    out = {(t, b): Series() for t in labels for b in BATCHES}
    floor: dict[str, list[int]] = {"bare": [], "empty": [], "hop": []}
    bare_kinds = [*BARE, "socket" + AFTER_IDLE] if idle is not None else list(BARE)
    bare_rounds: dict[str, dict[int, list[int]]] = {k: {b: [] for b in BATCHES} for k in bare_kinds}
    async with (
        grpc.aio.insecure_channel(target) as tc,
        grpc.aio.insecure_channel(draft) as dc,
        grpc.aio.insecure_channel(bare) as bc,
        contextlib.AsyncExitStack() as more,
    ):
        calls: list[RpcTiming] = []
        stubs = {t: round_stubs(t, tc, dc, (target, draft)) for t in transports}
        if baseline is not None:
            btc = await more.enter_async_context(grpc.aio.insecure_channel(baseline[0]))
            bdc = await more.enter_async_context(grpc.aio.insecure_channel(baseline[1]))
            for t in transports:
                stubs[t + second] = round_stubs(t, btc, bdc, baseline)
        if idle is not None:
            stubs[idle[0] + AFTER_IDLE] = stubs[idle[0]]
            if baseline is not None:
                stubs[idle[0] + second + AFTER_IDLE] = stubs[idle[0] + second]
        clients = {
            t: RoundClient(target_stub, draft_stub, on_rpc=calls.append)
            for t, (target_stub, draft_stub) in stubs.items()
        }
        batches = {
            (t, b): sessions(f"{t}-b{b}", b, seed=b + 1000 * i)
            for i, t in enumerate(labels)
            for b in BATCHES
        }
        stub = target_pb2_grpc.TargetServiceStub(tc)
        health = health_pb2_grpc.HealthStub(bc)
        echo = (EchoClient(bc), EchoClient(bc))
        references = {
            "bare": lambda: health.Check(health_pb2.HealthCheckRequest()),
            "empty": lambda: stub.GetLoad(common_pb2.GetLoadRequest()),
            "hop": lambda: stub.Release(common_pb2.ReleaseRequest(session_ids=["none"])),
        }
        for r in range(warmup + rounds):
            measured = r >= warmup
            for name, call in references.items():
                elapsed = await _timed(call)
                if measured:
                    floor[name].append(elapsed)
            for b in BATCHES:
                for t in labels:
                    if idle is not None and t.endswith(AFTER_IDLE):
                        await asyncio.sleep(idle[1])
                    calls.clear()
                    await clients[t].round(batches[(t, b)])
                    if measured:
                        out[(t, b)].add(calls)
                sizes = round_sizes(calls)
                for kind in bare_kinds:
                    if kind.endswith(AFTER_IDLE) and idle is not None:
                        await asyncio.sleep(idle[1])
                    elapsed = await bare_round(echo, kind.removesuffix(AFTER_IDLE), sizes)
                    if measured:
                        bare_rounds[kind][b].append(elapsed)
        for (t, _), states in batches.items():
            await clients[t].release(states)
        for target_stub, draft_stub in stubs.values():
            await close_stubs(target_stub, draft_stub)
        for client in echo:
            await client.close()
    return out, floor, bare_rounds


def servers(
    name: str, threads: int, tree: str | None = None
) -> tuple[ServerProcess, ServerProcess]:
    """The (target, draft) server processes for ``name`` (``floor``: the stub servers with
    their request conversion memoized); run from checkout ``tree`` (so its code comes
    first on their path) when given, else from here."""
    serving = ["--threads", str(threads), "--batch-window-ms", "0"]
    root = os.path.abspath(tree) if tree else None  # `python -m` puts the cwd first on the path
    if name in ("stub", "floor"):
        serving += ["--memoize-conversion"] if name == "floor" else []
        return (
            ServerProcess("target", ["target", *serving], module="bench.rpc_stub", cwd=root),
            ServerProcess("draft", ["draft", *serving], module="bench.rpc_stub", cwd=root),
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
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=12.0,
        help="also time the orchestrator's transport after this long with nothing to do "
        "(0: not), as when a device computes between calls",
    )
    second = parser.add_mutually_exclusive_group()
    second.add_argument(
        "--baseline",
        metavar="CHECKOUT",
        help="also run the stub servers of another checkout of specserve (e.g. a git "
        "worktree of an older commit) and drive them with the same rounds, interleaved",
    )
    second.add_argument(
        "--floor",
        action="store_true",
        help="also run stub servers whose request conversion is memoized (bench.rpc_stub "
        "--memoize-conversion), driven the same way: the framework's floor",
    )
    args = parser.parse_args(argv)
    if args.idle_ms < 0:
        parser.error(f"--idle-ms must be >= 0 (0: off), got {args.idle_ms:g}")
    if args.baseline and not os.path.isfile(os.path.join(args.baseline, "bench", "rpc_stub.py")):
        parser.error("--baseline must name a checkout of specserve (it has bench/rpc_stub.py)")
    env = environment()
    headline_transport = orchestrator_transport()
    unmeasurable = unavailable()
    transports = [t for t in TRANSPORTS if unmeasurable[t] is None]
    results: dict[str, dict[str, Any]] = {}
    for name in args.models.split(","):
        rounds = args.rounds if name == "stub" else args.tiny_rounds
        target, draft = servers(name, args.threads)
        bare = ServerProcess("bare", [], module="bench.bare_grpc")
        paired = name == "stub" and (args.floor or args.baseline)  # beside the stub pair only
        others = (
            servers("floor" if args.floor else name, args.threads, args.baseline) if paired else ()
        )
        with contextlib.ExitStack() as started:
            for process in (target, draft, bare, *others):  # a loaded machine imports slowly
                started.callback(process.stop)
                process.start(timeout_s=START_TIMEOUT_S)
            for process in (target, draft, bare, *others):
                process.wait_serving(START_TIMEOUT_S)
            baseline = (others[0].address, others[1].address) if others else None
            series, floor, bare_rounds = asyncio.run(
                measure(
                    target.address,
                    draft.address,
                    bare.address,
                    transports,
                    rounds,
                    args.warmup,
                    baseline,
                    (headline_transport, args.idle_ms / 1000) if args.idle_ms > 0 else None,
                    FLOOR if args.floor else BASELINE,
                )
            )
        results[name] = {
            "baseline_revision": revision(args.baseline) if baseline and args.baseline else None,
            "floor": bool(baseline) and args.floor,
            "idle_ms": args.idle_ms,
            "rounds": rounds,
            "warmup": args.warmup,
            "rows": report.summarize(series, bare_rounds),
            "reference_rpc_ns": floor,
            "samples_ns": {f"{t}/{b}": s.__dict__ for (t, b), s in series.items()},
            "bare_round_samples_ns": bare_rounds,
        }
    cost = asyncio.run(handler_cost(BATCHES, args.rounds))
    sections = [report.section(TITLES[name], r, headline_transport) for name, r in results.items()]
    sections.append(report.handling_section(BATCHES, cost))
    setup = {"k": K, "support": SUPPORT, "vocab": VOCAB, "transport": headline_transport}
    argv_list = list(argv) if argv is not None else sys.argv[1:]
    if args.baseline:  # a path of this machine: the results name the commit instead
        argv_list = ["--baseline=CHECKOUT" if a.startswith("--baseline=") else a for a in argv_list]
        argv_list = ["CHECKOUT" if a == args.baseline else a for a in argv_list]
    md = report.markdown(sections, unmeasurable, setup, env, argv_list)
    print(md)
    if not args.no_write:
        first = results.get("stub") or next(iter(results.values()))
        data = {
            "headline": report.headline(first["rows"], headline_transport),
            "environment": env,
            **setup,
            "transports_unavailable": {t: why for t, why in unmeasurable.items() if why},
            **results,
            "server_handling_p50_ms": cost,
        }
        write_results("rpc_overhead", md, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
