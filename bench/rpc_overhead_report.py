"""The figures, tables, targets and headline of :mod:`bench.rpc_overhead`.

Every figure is a percentile over the measured rounds of one run (milliseconds);
a round's overhead is its Propose's plus its Verify's (client wall time minus the
compute the server reported). The bare references are the same round's two
messages, byte for byte, echoed by a bare grpc.aio server (:mod:`bench.bare_grpc`)
as unary calls and as messages on two open bidirectional streams.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from bench.common import environment_md, reproduce_command

# Round overhead p50 the issue asks for, by batch size (ms).
TARGET_P50_MS = {8: 1.0, 32: 2.0}


def pct(values: Sequence[int], q: float) -> float:
    """The q-quantile of nanosecond samples, in milliseconds (inclusive method)."""
    if len(values) == 1:
        return values[0] / 1e6
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[round(q * 100) - 1] / 1e6


def spread(values: Sequence[int]) -> dict[str, float]:
    """p50, p90 and p99 in milliseconds."""
    return {f"p{round(q * 100)}": pct(values, q) for q in (0.5, 0.9, 0.99)}


def summarize(series: Mapping[tuple[str, int], Any], bare: Mapping[str, Any]) -> list[dict]:
    """One row per (transport, batch): the round's overhead and its two calls', compute,
    message sizes, and the bare unary / stream / socket round of the same bytes."""
    rows = []
    for (transport, b), s in series.items():
        rows.append(
            {
                "transport": transport,
                "batch": b,
                "rounds": len(s.round_ns),
                "round_ms": spread(s.round_ns),
                "propose_ms": spread(s.propose_ns),
                "verify_ms": spread(s.verify_ns),
                "compute_p50_ms": pct(s.compute_ns, 0.5),
                "propose_kib": statistics.median(s.propose_bytes) / 1024,
                "verify_kib": statistics.median(s.verify_bytes) / 1024,
                "bare_unary_round_ms": spread(bare["unary"][b]),
                "bare_stream_round_ms": spread(bare["stream"][b]),
                "bare_socket_round_ms": spread(bare["socket"][b]),
            }
        )
    return rows


def headline(rows: list[dict], transport: str) -> dict[str, Any]:
    """What the README quotes: the round overhead over ``transport`` by batch size, with
    the bare references, whether each target is met and (``--floor``) the floor's."""
    mine = {str(r["batch"]): r for r in rows if r["transport"] == transport}
    floor = {str(r["batch"]): r for r in rows if r["transport"] == transport + ", floor"}
    return {
        "transport": transport,
        "round_overhead_p50_ms": {b: r["round_ms"]["p50"] for b, r in mine.items()},
        "round_overhead_p90_ms": {b: r["round_ms"]["p90"] for b, r in mine.items()},
        "bare_unary_round_p50_ms": {b: r["bare_unary_round_ms"]["p50"] for b, r in mine.items()},
        "bare_stream_round_p50_ms": {b: r["bare_stream_round_ms"]["p50"] for b, r in mine.items()},
        "bare_socket_round_p50_ms": {b: r["bare_socket_round_ms"]["p50"] for b, r in mine.items()},
        "target_p50_ms": {str(b): t for b, t in TARGET_P50_MS.items()},
        "target_met": {
            b: r["round_ms"]["p50"] <= TARGET_P50_MS[int(b)]
            for b, r in mine.items()
            if int(b) in TARGET_P50_MS
        },
        "floor_round_overhead_p50_ms": {b: r["round_ms"]["p50"] for b, r in floor.items()},
    }


def table(rows: list[dict]) -> str:
    head = (
        "| sessions | transport | round p50 | round p90 | round p99 | Propose p50 / p90 "
        "| Verify p50 / p90 | bare unary round p50 / p90 | bare stream round p50 / p90 "
        "| bare socket round p50 / p90 | compute p50 | Propose msgs | Verify msgs |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [
        f"| {r['batch']} | {r['transport']} | **{r['round_ms']['p50']:.3f}** "
        f"| {r['round_ms']['p90']:.3f} | {r['round_ms']['p99']:.3f} "
        f"| {r['propose_ms']['p50']:.3f} / {r['propose_ms']['p90']:.3f} "
        f"| {r['verify_ms']['p50']:.3f} / {r['verify_ms']['p90']:.3f} "
        f"| {r['bare_unary_round_ms']['p50']:.3f} / {r['bare_unary_round_ms']['p90']:.3f} "
        f"| {r['bare_stream_round_ms']['p50']:.3f} / {r['bare_stream_round_ms']['p90']:.3f} "
        f"| {r['bare_socket_round_ms']['p50']:.3f} / {r['bare_socket_round_ms']['p90']:.3f} "
        f"| {r['compute_p50_ms']:.2f} | {r['propose_kib']:.1f} KiB | {r['verify_kib']:.1f} KiB |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def section(title: str, result: dict[str, Any], transport: str) -> str:
    rows, floor = result["rows"], result["reference_rpc_ns"]
    verdicts = []
    for b, target in TARGET_P50_MS.items():
        row = next((r for r in rows if r["batch"] == b and r["transport"] == transport), None)
        if row is not None:
            met = "meets" if row["round_ms"]["p50"] <= target else "misses"
            verdicts.append(
                f"batch {b}: {row['round_ms']['p50']:.3f} ms p50, which **{met}** the target "
                f"of <= {target:.1f} ms"
            )
    return f"""## {title}

{result["rounds"]} rounds per batch size and transport after {result["warmup"]} warm-up rounds.

{table(rows)}

Single-call references timed in the same loop: a health `Check` on a bare grpc.aio server
(no interceptors, no specserve code: Python gRPC's own floor)
{pct(floor["bare"], 0.5):.3f} ms p50 / {pct(floor["bare"], 0.9):.3f} ms p90; an empty
unary RPC of ours (`GetLoad`, answered on the event loop)
{pct(floor["empty"], 0.5):.3f} ms p50 / {pct(floor["empty"], 0.9):.3f} ms p90;
a round trip through the model thread with no work (`Release` of an unknown id)
{pct(floor["hop"], 0.5):.3f} ms p50 / {pct(floor["hop"], 0.9):.3f} ms p90.
Round overhead over the orchestrator's transport ({transport}): {"; ".join(verdicts)}.
{_after_idle(rows, transport, result)}{_baseline(rows, transport, result)}"""


def _after_idle(rows: list[dict], transport: str, result: dict[str, Any]) -> str:
    """The idle line: the same transport's rounds, and the bare socket echo's, after every
    process slept ``idle_ms`` (what a wake from idle costs on this machine)."""
    bare = result["bare_round_samples_ns"].get("socket, after idle", {})
    pairs = []
    for r in rows:
        if r["transport"] != transport + ", after idle":
            continue
        b = r["batch"]
        hot = next(x for x in rows if x["transport"] == transport and x["batch"] == b)
        cold, warm = r["round_ms"]["p50"], hot["round_ms"]["p50"]
        pairs.append(
            f"batch {b}: {cold:.3f} ms against {warm:.3f} (+{cold - warm:.3f}); the bare "
            f"socket echo {pct(bare[b], 0.5):.3f} against {r['bare_socket_round_ms']['p50']:.3f}"
        )
    if not pairs:
        return ""
    return (
        f"After {result['idle_ms']:g} ms with nothing to do (every process asleep, as while a "
        f"device computes; `--idle-ms`), the same rounds over {transport}: "
        f"{'; '.join(pairs)}.\n"
    )


def _baseline(rows: list[dict], transport: str, result: dict[str, Any]) -> str:
    """The ablation line: this code's rounds over ``transport`` against ``--baseline``'s
    or ``--floor``'s (the two pairs of servers had the same traffic, interleaved round by
    round)."""
    revision, floor = result["baseline_revision"], result.get("floor", False)
    if revision is None and not floor:
        return ""
    second = ", floor" if floor else ", baseline"
    p50 = {(r["transport"], r["batch"]): r["round_ms"]["p50"] for r in rows}
    pairs = []
    for when, mine in (("", transport), ("after idle, ", transport + ", after idle")):
        theirs = mine.replace(transport, transport + second, 1)
        for (label, b), old in p50.items():
            if label == theirs:
                new = p50[(mine, b)]
                pairs.append(f"{when}batch {b}: {new:.3f} ms against {old:.3f} ({new / old:.2f}x)")
    if floor:
        return (
            f"Floor (`--floor`): this code's {transport} rounds against the same stub servers "
            "with every request's conversion memoized (`bench.rpc_stub --memoize-conversion`: "
            "validation, conversion and the draft's response building at ~0; what is left "
            "is the framework, the transport and the hop to the model thread), interleaved "
            f"in the same loop: {'; '.join(pairs)}.\n"
        )
    return (
        f"Ablation (`--baseline`): this code's {transport} rounds against the servers of "
        f"commit {revision}, interleaved in the same loop: {'; '.join(pairs)}.\n"
    )


def handling_section(batches: Sequence[int], cost: dict[str, list[float]]) -> str:
    rows = "\n".join(
        f"| {b} | {p:.3f} | {v:.3f} | {p + v:.3f} |"
        for b, p, v in zip(batches, cost["propose"], cost["verify"], strict=True)
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
    sections: list[str],
    transports: dict[str, str | None],
    setup: dict[str, Any],
    env: dict[str, Any],
    argv: list[str],
) -> str:
    """The whole results page. ``transports`` maps each transport to why it was not
    measured (``None``: measured)."""
    skipped = "".join(
        f"\n- The {t} transport was not measured: {why}" for t, why in transports.items() if why
    )
    return f"""# RPC overhead of a speculative round

Per round, time spent outside model compute: for each RPC the client's wall time
minus the `compute_ns` the server reports, summed over the round's `Propose` and
`Verify`. Milliseconds, p50 / p90 / p99, one run, batch sizes and transports interleaved
round by round.

Setup: draft and target servers as separate processes on loopback, driven by
`RoundClient` (`bench/round_client.py`: the orchestrator's Propose and Verify
messages) over each transport: `socket` (one connection to each replica's data-plane
socket, length-prefixed frames of the same messages: the orchestrator's one transport)
and `unary` (one call per Propose / Verify: other clients');
k = {setup["k"]}, sampled drafting, so each draft position carries a sparse q of
{setup["support"]} ids + probabilities (`SparseQ`, packed little-endian); vocabulary
{setup["vocab"]:,}; servers with `--batch-window-ms 0 --threads 1` (the coalescing window,
2 ms by default, is a deliberate wait for other callers and would add up to its length to
a lone call). "Msgs" is request + response size per RPC. The bare rounds send the same
round's Propose and Verify bytes, both ways, to an echo service on a bare grpc.aio server
(`bench/bare_grpc.py`): as two unary calls, as one message on each of two open
bidirectional streams, and as one frame on each of two connections to a plain TCP
echo beside it (asyncio streams); the floor each transport sets before any specserve
code runs.
The headline is the round over the transport the orchestrator uses:
**{setup["transport"]}**.{skipped}

{"".join(sections)}
Reproduce: `{reproduce_command("bench.rpc_overhead", argv)}`

Environment:
{environment_md(env)}
- load average at the start: {env["load_average"]} (a shared machine: other jobs ran
  alongside; every wake-up of a server or client thread can wait for a core)
"""
