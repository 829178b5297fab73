"""The figures, table, plot and target checks of :mod:`bench.concurrency`.

Every figure of a variant at one concurrency is the median over repetitions;
"vs plain" is the median of the per-repetition ratios (the variants ran back to
back within a repetition, on the same prompts). Latency percentiles pool every
stream of every repetition.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.common import environment_md, reproduce_command

if TYPE_CHECKING:
    from bench.concurrency import LocalRun, Run

PLAIN = "plain (k = 0)"
ADAPTIVE = LOCAL_ADAPTIVE = "adaptive k"
SINGLE_SESSION_TARGET = 0.95
# Adaptive speculation may cost at most 2% against plain decoding (median over
# repetitions) at any concurrency: the spread between repetitions of one variant.
PLAIN_FLOOR = 0.98


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (inclusive method); NaN without data."""
    if not values:
        return math.nan
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def default_adaptive(names: Sequence[str]) -> str | None:
    """The adaptive variant the orchestrator's defaults give, else any adaptive one run."""
    if ADAPTIVE in names:
        return ADAPTIVE
    return next((n for n in names if n != PLAIN), None)


def variant_row(runs: list[Run], plain: dict[tuple[int, int], Run]) -> dict[str, Any]:
    """One variant at one concurrency over its repetitions, against plain (keyed by
    (repetition, concurrency)): medians, per-repetition ratios, latencies, wrong streams."""
    per_token: list[float] = []
    gaps: list[float] = []
    wrong = eos = 0
    for r in runs:
        base = plain.get((r.rep, r.concurrency))
        for i, s in enumerate(r.streams):
            itl, gap = s.latencies()
            per_token += itl
            gaps += gap
            eos += s.finish == "eos"
            wrong += base is not None and s.tokens != base.streams[i].tokens
    streams = [s for r in runs for s in r.streams]
    drafted = sum(s.drafted for s in streams)
    accepted = sum(s.accepted for s in streams)
    rounds = sum(s.rounds for s in streams)
    ordered = sorted(runs, key=lambda r: r.rep)
    ratios = [r.tokens_per_s / plain[(r.rep, r.concurrency)].tokens_per_s for r in ordered]
    return {
        "variant": runs[0].variant,
        "concurrency": runs[0].concurrency,
        "reps": len(runs),
        "tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
        "ratio_vs_plain": statistics.median(ratios),
        "ratios_by_rep": ratios,
        "itl_p50_ms": 1e3 * pct(per_token, 0.5),
        "itl_p99_ms": 1e3 * pct(per_token, 0.99),
        "stall_p99_ms": 1e3 * pct(gaps, 0.99),
        "ttft_p50_s": pct([s.ttft_s for s in streams if s.arrivals], 0.5),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / rounds if rounds and drafted else None,
        "k_cap_rounds": {
            cap: sum(r.k_caps.get(cap, 0.0) for r in runs)
            for cap in sorted({cap for r in runs for cap in r.k_caps})
        },
        "wrong_streams": wrong,
        "eos_streams": eos,
        "streams": len(streams),
    }


def _local_row(name: str, mine: list[LocalRun], stack_name: str, runs: list[Run]) -> dict[str, Any]:
    """A local variant against the stack's single sessions of ``stack_name``, prompt by prompt."""
    singles = {r.rep: r for r in runs if r.variant == stack_name and r.concurrency == 1}
    pairs = [(singles[r.rep], r) for r in mine if r.rep in singles]
    drafted = sum(r.drafted for r in mine)
    return {
        "variant": name,
        "stack_variant": stack_name,
        "tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
        "stack_tokens_per_s": (
            statistics.median(s.tokens_per_s for s, _ in pairs) if pairs else None
        ),
        "stack_over_local": (
            statistics.median(s.tokens_per_s / r.tokens_per_s for s, r in pairs) if pairs else None
        ),
        "acceptance_rate": sum(r.accepted for r in mine) / drafted if drafted else None,
        "same_tokens_as_stack": sum(s.streams[0].tokens == r.tokens for s, r in pairs),
        "pairs": len(pairs),
    }


def summarize(runs: list[Run], local: list[LocalRun], variants: Sequence[str]) -> dict[str, Any]:
    plain = {(r.rep, r.concurrency): r for r in runs if r.variant == PLAIN}
    stack_rows = []
    for c in sorted({r.concurrency for r in runs}):
        for v in variants:
            mine = [r for r in runs if r.variant == v and r.concurrency == c]
            if mine:
                stack_rows.append(variant_row(mine, plain))
    local_rows = []
    for name in dict.fromkeys(r.variant for r in local):
        mine = [r for r in local if r.variant == name]
        for stack_name in [PLAIN] if name == PLAIN else [v for v in variants if v != PLAIN]:
            local_rows.append(_local_row(name, mine, stack_name, runs))
    return {"stack": stack_rows, "local": local_rows, "targets": targets(stack_rows, local_rows)}


def headline(summary: dict[str, Any]) -> dict[str, Any]:
    """The run's ratios: adaptive over plain by sessions, one session's stack over local."""
    t = summary["targets"]
    return {
        "adaptive_over_plain": t["adaptive_vs_plain"],
        "never_worse_than_plain": t["never_worse_than_plain"],
        "plain_floor": PLAIN_FLOOR,
        "stack_over_local": t["single_session_stack_over_local"],
    }


def targets(stack_rows: list[dict[str, Any]], local_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's two targets, computed from this run."""
    adaptive = default_adaptive([r["variant"] for r in stack_rows])
    by_c = {r["concurrency"]: r["ratio_vs_plain"] for r in stack_rows if r["variant"] == adaptive}
    single = next(
        (
            r
            for r in local_rows
            if r["variant"] == LOCAL_ADAPTIVE and r["stack_variant"] == adaptive
        ),
        None,
    )
    ratio = single["stack_over_local"] if single else None
    others = {r["variant"]: {} for r in stack_rows if r["variant"] not in (PLAIN, adaptive)}
    for r in stack_rows:
        if r["variant"] in others:
            others[r["variant"]][r["concurrency"]] = r["ratio_vs_plain"]
    return {
        "adaptive_variant": adaptive,
        "adaptive_vs_plain": by_c,
        "other_variants_vs_plain": others,
        "never_worse_than_plain": bool(by_c) and all(x >= PLAIN_FLOOR for x in by_c.values()),
        "single_session_stack_over_local": ratio,
        "single_session_met": ratio is not None and ratio >= SINGLE_SESSION_TARGET,
    }


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _caps(row: dict[str, Any]) -> str:
    """Batch rounds by the k cap they ran under, e.g. ``0: 12, 4: 30``."""
    caps = row.get("k_cap_rounds") or {}
    return ", ".join(f"{cap}: {n:.0f}" for cap, n in caps.items()) or "–"


def _ratios(row: dict[str, Any]) -> str:
    """``0.96x (0.78, 1.15)``: the median ratio, then each repetition's."""
    reps = row.get("ratios_by_rep") or []
    each = f" ({', '.join(f'{x:.2f}' for x in reps)})" if len(reps) > 1 else ""
    return f"{row['ratio_vs_plain']:.2f}x{each}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def weight_form(model: str) -> str:
    """``", GGUF weights <form>"`` for a GGUF model on a CPU server (the form its name asks
    for, else the default the servers resolve); empty for tiny models, which have none."""
    if model.startswith("tiny"):
        return ""
    from specserve.engine.gguf_weights import default_weight_form
    from specserve.engine.model_spec import ModelSpec

    form = ModelSpec.parse(model).weights or default_weight_form(torch.device("cpu"))
    return f", GGUF weights {form.value}"


def _stores(args: argparse.Namespace) -> str:
    if getattr(args, "store", "embedded") == "redis":
        return "session store: a redis-server on loopback"
    return "embedded session stores"


def markdown(
    summary: dict[str, Any],
    args: argparse.Namespace,
    env: dict[str, Any],
    argv: list[str] | None = None,
) -> str:
    """The results page; ``argv``: the run's arguments, for its reproduce line (None: the
    process's own)."""
    t = summary["targets"]
    widest = max(args.concurrency)
    lines = [
        "# Concurrent sessions: plain batched decoding vs adaptive speculation",
        "",
        f"Target {args.target} ({args.target_dtype} compute{weight_form(args.target)}), "
        f"draft {args.draft} ({args.draft_dtype} compute{weight_form(args.draft)}): "
        "target server, draft server and orchestrators as separate processes on loopback "
        f"({_stores(args)}), {args.threads} torch threads per server. Streaming "
        f"`GenerateStream` requests, greedy, at most {args.new_tokens} new tokens each, "
        f"HumanEval prompts (raw), {args.reps} repetitions: repetition j sends problems "
        f"{widest}j..{widest}j+c-1 at concurrency c, the same to every variant; variants run "
        "back to back at every concurrency. Figures are medians over repetitions; latency "
        "percentiles pool all streams.",
    ]
    if args.emulate_devices:
        lines += [
            "",
            f"**Emulated devices:** every draft forward takes {args.emulate_devices[0]:g} ms "
            f"and every target forward {args.emulate_devices[1]:g} ms of device time with the "
            "CPU idle (`bench.emulated_device`), in the servers and in the local loop alike.",
        ]
    device = getattr(args, "device", "cpu")
    if device != "cpu":
        lines += [
            "",
            f"**Device:** both servers and the local loop compute on `{device}` "
            f"({env.get('accelerator') or 'no accelerator name recorded'}); the "
            f"orchestrator declares its devices `{env.get('declared_devices', 'shared')}`.",
        ]
    lines += [
        "",
        "## Throughput and latency",
        "",
        "tok/s: every stream's tokens over the wall time from the first request to the last "
        "token. vs plain: the median of the repetitions' ratios, each repetition's in "
        "brackets (in repetition 0 the measured k cap meets each batch size for the first "
        "time and explores; later ones run on what it measured). "
        "ITL: a message with n tokens arriving g after the previous one counts n "
        "latencies of g/n; stall: g itself. Rounds by k cap: the orchestrator's batch rounds "
        "by the k cap they ran under (the load curve's bound, or under it the cap with the "
        "best predicted goodput; 0 = no drafts; sessions with cold draft caches verify at "
        "k = 0 under any cap). `wrong`: streams whose tokens differ from "
        "plain decoding's.",
        "",
        "| sessions | variant | tok/s | vs plain | ITL p50 ms | ITL p99 ms | stall p99 ms "
        "| TTFT p50 s | acceptance | mean acc. length | rounds by k cap | wrong |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in summary["stack"]:
        lines.append(
            f"| {r['concurrency']} | {r['variant']} | {r['tokens_per_s']:.2f} | "
            f"{_ratios(r)} | {_num(r['itl_p50_ms'], '.0f')} | "
            f"{_num(r['itl_p99_ms'], '.0f')} | {_num(r['stall_p99_ms'], '.0f')} | "
            f"{_num(r['ttft_p50_s'])} | {_pct(r['acceptance_rate'])} | "
            f"{_num(r['mean_acceptance_length'])} | {_caps(r)} | "
            f"{r['wrong_streams']} |"
        )
    if summary["local"]:
        lines += [
            "",
            "## The local loop (one session, in process)",
            "",
            "`specserve.local.LocalRunner` on the same models, dtypes, threads and prompts "
            "as the stack's single sessions, run in a child process before the servers "
            "started (never both in memory), so not interleaved with the stack.",
            "",
            "| variant | local tok/s | stack variant | stack tok/s (1 session) | stack / local "
            "| acceptance | same tokens |",
            "|---|---:|---|---:|---:|---:|---:|",
        ]
        for r in summary["local"]:
            lines.append(
                f"| {r['variant']} | {r['tokens_per_s']:.2f} | {r['stack_variant']} | "
                f"{_num(r['stack_tokens_per_s'])} | {_num(r['stack_over_local'])}x | "
                f"{_pct(r['acceptance_rate'])} | {r['same_tokens_as_stack']}/{r['pairs']} |"
            )
    lines += ["", "## Against the targets", ""]
    by_c = ", ".join(f"{c}: {x:.2f}x" for c, x in t["adaptive_vs_plain"].items())
    met = "**met**" if t["never_worse_than_plain"] else "**not met**"
    lines.append(
        f"- Adaptive speculation ({t['adaptive_variant']}) >= {PLAIN_FLOOR}x plain decoding "
        f"at every concurrency: {met} ({by_c or 'not measured'})."
    )
    for name, ratios in t["other_variants_vs_plain"].items():
        by_c = ", ".join(f"{c}: {x:.2f}x" for c, x in ratios.items())
        lines.append(f"  For comparison, {name} vs plain: {by_c}.")
    ratio = t["single_session_stack_over_local"]
    if ratio is None:
        lines.append("- Distributed single session >= 0.95x the local loop: not measured.")
    else:
        met = "**met**" if t["single_session_met"] else "**not met**"
        lines.append(
            f"- Distributed single-session tokens/s >= {SINGLE_SESSION_TARGET}x the local "
            f"loop's (adaptive k): {met} ({ratio:.2f}x)."
        )
    eos = sum(r["eos_streams"] for r in summary["stack"])
    total = sum(r["streams"] for r in summary["stack"])
    others = env.get("others_cpu_share")
    lines += [
        "",
        f"The API cannot ignore EOS: {eos} of {total} streams ended on EOS before "
        f"{args.new_tokens} tokens (tok/s counts the tokens generated). Other processes "
        f"used {_pct(others)} of the CPUs during the run; it took "
        f"{env.get('bench_minutes', 0):.0f} min.",
        "",
        "Reproduce:",
        "",
        "```",
        reproduce_command("bench.concurrency", argv),
        "```",
        "",
        environment_md(env),
    ]
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path, args: argparse.Namespace) -> bool:
    """Tokens/s and inter-token latency by concurrency; returns whether a plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (tput, lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(dict.fromkeys(r["variant"] for r in summary["stack"]))
    for i, name in enumerate(names):
        rows = [r for r in summary["stack"] if r["variant"] == name]
        cs = [r["concurrency"] for r in rows]
        color = f"C{i}"
        tput.plot(cs, [r["tokens_per_s"] for r in rows], marker="o", color=color, label=name)
        lat.plot(cs, [r["itl_p50_ms"] for r in rows], marker="o", color=color, label=f"{name} p50")
        lat.plot(cs, [r["itl_p99_ms"] for r in rows], ls="--", color=color, label=f"{name} p99")
    local = {r["variant"]: r["tokens_per_s"] for r in summary["local"]}
    for name, value in local.items():
        tput.scatter([1], [value], marker="x", s=60, label=f"local {name}")
    for ax in (tput, lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.concurrency, [str(c) for c in args.concurrency])
        ax.set_xlabel("concurrent sessions")
        ax.legend(fontsize=7)
    tput.set_ylabel("aggregate tokens/s")
    lat.set_ylabel("inter-token latency (ms)")
    fig.suptitle(f"{args.target} / {args.draft}, greedy, {args.new_tokens} tokens per session")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
