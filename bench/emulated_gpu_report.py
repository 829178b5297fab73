"""The figures, targets, tables and plot of :mod:`bench.emulated_gpu`.

Per setting: every stack figure at one session count is the median over
repetitions, and "adaptive / plain" the median of the per-repetition ratios (both
variants ran back to back on the same prompts); "stack / local" is the median over
repetitions of the stack's single session over the local loop on the same prompt.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import environment_md, reproduce_command
from bench.concurrency_report import variant_row
from bench.emulated_gpu_phases import PARTS
from bench.steady_load import section as steady_section

if TYPE_CHECKING:
    from bench.concurrency import LocalRun
    from bench.serving_stack import Run

# The targets: one session through the stack over the local loop, by setting
# (plain and adaptive alike); adaptive over plain by setting and sessions; and adaptive
# never below plain anywhere.
STACK_OVER_LOCAL_TARGETS = {"2/12": 0.95, "1/6": 0.9}
ADAPTIVE_OVER_PLAIN_TARGETS = {"2/12": {8: 1.5, 32: 1.2}}
NEVER_BELOW_PLAIN = 1.0


def _local_summary(mine: list[LocalRun]) -> dict[str, Any]:
    drafted = sum(r.drafted for r in mine)
    rounds = sum(r.rounds for r in mine)
    return {
        "tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
        "ms_per_round": 1e3 * statistics.median(r.seconds / r.rounds for r in mine if r.rounds),
        "acceptance_rate": sum(r.accepted for r in mine) / drafted if drafted else None,
        "mean_acceptance_length": 1 + sum(r.accepted for r in mine) / rounds if rounds else None,
    }


def _greedy(runs: list[Run], local: list[LocalRun], rows: list[dict[str, Any]]) -> dict[str, int]:
    """Streams compared with plain decoding's tokens for the same prompt, and how many differ."""
    compared = sum(r["streams"] for r in rows if r["variant"] != "plain")
    differing = sum(r["wrong_streams"] for r in rows)
    plain_local = {r.rep: r.tokens for r in local if r.variant == "plain"}
    plain_single = {
        r.rep: r.streams[0].tokens for r in runs if r.variant == "plain" and r.concurrency == 1
    }
    for r in local:
        base = plain_local.get(r.rep)
        if r.variant != "plain" and base is not None:  # local adaptive vs local plain
            compared += 1
            differing += r.tokens != base
    for rep, tokens in plain_local.items():  # local plain vs the stack's single session
        if rep in plain_single:
            compared += 1
            differing += tokens != plain_single[rep]
    return {"compared": compared, "differing": differing}


def summarize_setting(
    runs: list[Run], local: list[LocalRun], phases: dict[str, Any]
) -> dict[str, Any]:
    """Stack rows by (sessions, variant), the local loop, the ratios, greedy checks, phases."""
    plain = {(r.rep, r.concurrency): r for r in runs if r.variant == "plain"}
    rows = []
    for c in sorted({r.concurrency for r in runs}):
        for name in ("plain", "adaptive"):
            mine = [r for r in runs if r.variant == name and r.concurrency == c]
            if mine:
                rows.append(variant_row(mine, plain))
    local_by_variant = {
        name: _local_summary([r for r in local if r.variant == name])
        for name in dict.fromkeys(r.variant for r in local)
    }
    stack_over_local: dict[str, Any] = {}
    for name in local_by_variant:
        singles = {r.rep: r for r in runs if r.variant == name and r.concurrency == 1}
        ratios = [
            singles[r.rep].tokens_per_s / r.tokens_per_s
            for r in sorted(local, key=lambda r: r.rep)
            if r.variant == name and r.rep in singles
        ]
        if ratios:
            stack_over_local[name] = {"median": statistics.median(ratios), "by_rep": ratios}
    return {
        "stack": rows,
        "local": local_by_variant,
        "stack_over_local": stack_over_local,
        "adaptive_over_plain": {
            str(r["concurrency"]): r["ratio_vs_plain"] for r in rows if r["variant"] == "adaptive"
        },
        "greedy": _greedy(runs, local, rows),
        "phases": phases,
    }


def targets(per_setting: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every target of the issue this run measured: claim, measured, target, met."""
    out = []
    for label, s in per_setting.items():
        for variant, ratio in s["stack_over_local"].items():
            if label in STACK_OVER_LOCAL_TARGETS:
                target = STACK_OVER_LOCAL_TARGETS[label]
                claim = f"{label}: one session through the stack / local loop, {variant}"
                out.append(_target(claim, ratio["median"], target))
        for sessions, ratio in s["adaptive_over_plain"].items():
            target = ADAPTIVE_OVER_PLAIN_TARGETS.get(label, {}).get(int(sessions))
            if target is None:
                target = NEVER_BELOW_PLAIN
            claim = f"{label}: adaptive / plain through the stack at {sessions} sessions"
            out.append(_target(claim, ratio, target))
        for sessions, st in s.get("steady", {}).items():
            if st["ratio"] is None:
                continue
            target = ADAPTIVE_OVER_PLAIN_TARGETS.get(label, {}).get(int(sessions))
            claim = (
                f"{label}: adaptive / plain through the stack at {sessions} sessions, "
                "constant concurrency"
            )
            out.append(_target(claim, st["ratio"], target or NEVER_BELOW_PLAIN))
    return out


def _target(claim: str, measured: float, target: float) -> dict[str, Any]:
    return {"claim": claim, "measured": measured, "target": target, "met": measured >= target}


def headline(per_setting: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the README quotes, keyed by setting (``"2/12"``) and then variant or sessions."""
    return {
        "stack_over_local": {
            label: {v: r["median"] for v, r in s["stack_over_local"].items()}
            for label, s in per_setting.items()
        },
        "adaptive_over_plain": {
            label: s["adaptive_over_plain"] for label, s in per_setting.items()
        },
        "adaptive_over_plain_steady": {
            label: {c: st["ratio"] for c, st in s.get("steady", {}).items()}
            for label, s in per_setting.items()
        },
        "greedy_equal": all(
            s["greedy"]["differing"] == 0
            and all(st["wrong_streams"] == 0 for st in s.get("steady", {}).values())
            for s in per_setting.values()
        ),
        "targets": targets(per_setting),
    }


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def setting_section(label: str, s: dict[str, Any]) -> list[str]:
    draft_ms, _, target_ms = label.partition("/")
    lines = [
        f"## Draft {draft_ms} ms / target {target_ms} ms per forward",
        "",
        "| sessions | variant | tok/s | adaptive / plain (by repetition) | ITL p50 ms "
        "| ITL p99 ms | acceptance | mean acc. length | rounds by k cap | wrong |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in s["stack"]:
        ratio = "–"
        if r["variant"] != "plain":
            each = ", ".join(f"{x:.2f}" for x in r["ratios_by_rep"])
            ratio = f"**{r['ratio_vs_plain']:.2f}x** ({each})"
        caps = ", ".join(f"{c}: {n:.0f}" for c, n in r["k_cap_rounds"].items()) or "–"
        lines.append(
            f"| {r['concurrency']} | {r['variant']} | {r['tokens_per_s']:.1f} | {ratio} "
            f"| {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {_pct(r['acceptance_rate'])} "
            f"| {_num(r['mean_acceptance_length'])} | {caps} | {r['wrong_streams']} |"
        )
    lines += [
        "",
        "| local loop | tok/s | ms per round | acceptance | stack / local, one session "
        "(by repetition) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in s["local"].items():
        ratio = s["stack_over_local"].get(name)
        cell = "–"
        if ratio is not None:
            each = ", ".join(f"{x:.2f}" for x in ratio["by_rep"])
            cell = f"**{ratio['median']:.2f}x** ({each})"
        lines.append(
            f"| {name} | {r['tokens_per_s']:.1f} | {r['ms_per_round']:.2f} "
            f"| {_pct(r['acceptance_rate'])} | {cell} |"
        )
    lines += ["", "Where a decode round of one traced session goes (mean ms per round):", ""]
    lines += [
        "| variant | rounds | " + " | ".join(PARTS) + " | round |",
        "|---|---:|" + "---:|" * (len(PARTS) + 1),
    ]
    for name, p in s["phases"].items():
        ms = p["ms_per_round"]
        cells = " | ".join(_num(ms.get(k)) for k in [*PARTS, "round"])
        lines.append(f"| {name} | {p['rounds']} | {cells} |")
    g = s["greedy"]
    lines += ["", f"Greedy equality: {g['differing']} of {g['compared']} streams differ.", ""]
    if s.get("steady") or s.get("closed_tail"):
        lines += steady_section(s.get("steady", {}), s.get("closed_tail", {}))
    return lines


def _store(args: dict[str, Any]) -> str:
    if args.get("store", "embedded") == "redis":
        return "a redis-server on loopback, as deployed"
    return "embedded in the orchestrator (its Lua runs in the orchestrator's process)"


def _ahead(args: dict[str, Any]) -> str:
    n = args.get("draft_ahead", 0)
    if not n:
        return "the draft server does not draft ahead"
    return (
        f"the draft server drafts up to {n} tokens ahead while idle (`--draft-ahead {n}`, "
        "as the gpu overlay deploys it; the local loop, one process, has no idle device to "
        "draft on)"
    )


def fidelity_section(fidelity: dict[str, Any] | None) -> list[str]:
    """The tiny models' own time per forward (CPU, or the real forward on the GPU the
    models ran on), and where it passes the device time."""
    if not fidelity:
        return []
    cpu, device = fidelity["cpu_ms"], fidelity.get("device", "cpu")
    own = "CPU time" if device == "cpu" else f"time on {device}"
    how = "" if device == "cpu" else " (synchronised: the real forward's launches and kernels)"
    widths = sorted({int(n) for kind in cpu.values() for n in kind})
    lines = [
        "## Emulation fidelity",
        "",
        f"A forward lasts the longer of its device time and the tiny model's own {own}. "
        f"That time alone{how}, measured in a child process on the same prompts (median ms "
        "per forward):",
        "",
        "| forward | " + " | ".join(f"{n} sessions" for n in widths) + " |",
        "|---|" + "---:|" * len(widths),
    ]
    for kind, by_width in cpu.items():
        cells = " | ".join(f"{by_width[n]:.2f}" for n in widths)
        lines.append(f"| {kind.replace('_', ' ')} | {cells} |")
    lines.append("")
    prefill = fidelity.get("prefill_cpu_ms")
    if prefill:
        lines += [
            f"One prompt's prefill (median of {prefill['tokens']:.0f} tokens): "
            f"{prefill['draft_prefill']:.2f} ms ({own}) on the draft, "
            f"{prefill['target_prefill']:.2f} ms on the target. A session that joins a running "
            "batch adds its target prefill to that round, and under speculation its draft's "
            "warm-up beside it; where these pass the device time, joins cost that time.",
            "",
        ]
    for label, bound in fidelity["cpu_bound"].items():
        if bound:
            lines.append(
                f"- {label}: the real forwards, not the emulated device, set these forwards' time: "
                + "; ".join(bound)
                + "."
            )
        else:
            lines.append(f"- {label}: every forward's {own} stays under its device time.")
    return [*lines, ""]


def _device(args: dict[str, Any], env: dict[str, Any]) -> list[str]:
    """The paragraph naming the accelerator the models ran on (none on a CPU)."""
    if args.get("device", "cpu") == "cpu":
        return []
    return [
        "",
        f"**Device:** both servers and the local loop run their models on `{args['device']}` "
        f"({env.get('accelerator')}): every kernel is real and a forward lasts the emulated "
        "device time, or its own launches and copies where those take longer.",
    ]


def markdown(data: dict[str, Any], argv: list[str], stem: str = "emulated_gpu") -> str:
    """The results page; ``stem`` names its plot (``<stem>.png`` beside it)."""
    args, env, h = data["args"], data["environment"], data["headline"]
    lines = [
        "# Rounds at accelerator speed (emulated devices)",
        "",
        f"Target `{args['target']}`, draft `{args['draft']}` ({args['draft_dtype']}), every "
        "forward taking a fixed device time while the CPU idles (`bench/emulated_device.py`), "
        "in the servers and the local loop alike. The stack: target server, draft server and "
        "one orchestrator declared `--devices separate` with a prefill budget of "
        f"{args.get('max_prefill_tokens', 512)} tokens a round (a forward costs the same at "
        "any width here), separate processes on loopback, "
        f"{args['threads']} torch thread(s) each; session store: {_store(args)}; "
        f"{_ahead(args)}. Greedy, EOS "
        f"ignored, {args['new_tokens']} tokens per stream, HumanEval prompts as bytes, "
        f"{args['reps']} repetitions; plain "
        "(k = 0) and adaptive (the orchestrator's defaults) interleaved at every session "
        "count on the same prompts. The local loop (one session) ran in a child process "
        "before each setting's stack, on the prompts of the stack's single sessions. ITL: a "
        "message of n tokens g after the previous one counts n latencies of g / n.",
        *_device(args, env),
        "",
        "## Against the targets",
        "",
    ]
    for t in h["targets"]:
        verdict = "**met**" if t["met"] else "**not met**"
        lines.append(f"- {t['claim']}: {t['measured']:.2f}x (target >= {t['target']:g}x) {verdict}")
    equal = "every stream equal to plain decoding's" if h["greedy_equal"] else "**streams differ**"
    lines += [f"- Greedy equality: {equal}.", "", f"![where a round goes]({stem}.png)", ""]
    for label, s in data["settings"].items():
        lines += setting_section(label, s)
    lines += fidelity_section(data.get("fidelity"))
    others = env.get("other_processes_cpu_share")
    lines += [
        f"Other processes used {_pct(others)} of the CPUs during the run; it took "
        f"{env.get('bench_minutes', 0):.0f} min. Device parts: the model-thread spans (device "
        "time plus the tiny models' CPU time); transport: client span minus server span; "
        "servers: server span minus model-thread span; store: the session-store commit; "
        "orchestrator: the rest of the round span.",
        "",
        "Reproduce:",
        "",
        "```",
        reproduce_command("bench.emulated_gpu", argv),
        "```",
        "",
        environment_md(env),
    ]
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> bool:
    """Left: mean ms per decode round by part, per setting and variant, beside the local
    loop's round; right: tokens/s by sessions. Returns whether a plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (parts, tput) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels: list[str] = []
    for label, s in data["settings"].items():
        for name, p in s["phases"].items():
            ms = p["ms_per_round"]
            if not ms:
                continue
            y = len(labels)
            labels.append(f"{label} {name}")
            left = 0.0
            for i, part in enumerate(PARTS):
                parts.barh(y, ms[part], left=left, color=f"C{i}", label=part if y == 0 else None)
                left += ms[part]
            local = s["local"].get(name)
            if local is not None:
                parts.plot([local["ms_per_round"]] * 2, [y - 0.4, y + 0.4], color="black")
        for j, name in enumerate(("plain", "adaptive")):
            rows = [r for r in s["stack"] if r["variant"] == name]
            style = "-" if j == 0 else "--"
            tput.plot(
                [r["concurrency"] for r in rows],
                [r["tokens_per_s"] for r in rows],
                style,
                marker="o",
                label=f"{label} {name}",
            )
    parts.set_yticks(range(len(labels)), labels)
    parts.invert_yaxis()
    parts.set_xlabel("ms per decode round, one session (black bar: the local loop's round)")
    parts.legend(fontsize=7)
    tput.set_xscale("log", base=2)
    tput.set_xlabel("concurrent sessions")
    tput.set_ylabel("aggregate tokens/s through the stack")
    tput.legend(fontsize=7)
    fig.suptitle("Emulated devices: where a round goes, and throughput by sessions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
