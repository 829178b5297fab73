"""The figures, headline and table of :mod:`bench.experiments.policy_ablation`.

Per variant and concurrency: the median tokens/s over repetitions; "vs plain" is
the median of the per-repetition ratios to plain decoding (the variants ran back
to back within a repetition, on the same prompts); the spread is (max - min) /
median of the repetitions' tokens/s. "vs default" is the same per-repetition ratio
to the full default policy, and its verdict says whether the difference beats the
spread between repetitions: ``faster`` or ``slower`` when every repetition's ratio
lies on the same side of 1, ``within spread`` when they straddle it, ``one rep``
when there is a single repetition to judge. A component whose switched variant is
``within spread`` of the default at every concurrency does not earn its place.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bench.common import environment_md
from bench.concurrency_report import variant_row

if TYPE_CHECKING:
    from bench.experiments.policy_ablation import Variant
    from bench.serving_stack import Run

PLAIN = "plain"
DEFAULT = "default"
NEVER_WORSE = 0.98  # the bar for the default policy against plain decoding


def verdict(ratios: Sequence[float]) -> str:
    """Whether per-repetition ratios beat the spread: all above 1, all below, or neither."""
    if len(ratios) < 2:
        return "one rep"
    if all(r > 1 for r in ratios):
        return "faster"
    if all(r < 1 for r in ratios):
        return "slower"
    return "within spread"


def _by_rep(runs: Sequence[Run]) -> dict[int, Run]:
    return {r.rep: r for r in runs}


def summarize(runs: Sequence[Run], variants: Mapping[str, Variant]) -> dict[str, Any]:
    """Rows (one per concurrency and variant, in run order) and the headline."""
    plain = {(r.rep, r.concurrency): r for r in runs if r.variant == PLAIN}
    rows = []
    for c in sorted({r.concurrency for r in runs}):
        default = _by_rep([r for r in runs if r.variant == DEFAULT and r.concurrency == c])
        for name, v in variants.items():
            mine = sorted(
                (r for r in runs if r.variant == name and r.concurrency == c), key=lambda r: r.rep
            )
            if not mine:
                continue
            row = variant_row(mine, plain)
            speeds = [r.tokens_per_s for r in mine]
            versus = [
                r.tokens_per_s / default[r.rep].tokens_per_s for r in mine if r.rep in default
            ]
            row.update(
                label=v.label,
                fixed_k=v.k if v.drafter != "none" else None,
                tokens_per_s_by_rep=speeds,
                spread=(max(speeds) - min(speeds)) / statistics.median(speeds),
                vs_default=(
                    {
                        "median": statistics.median(versus),
                        "by_rep": versus,
                        "verdict": verdict(versus),
                    }
                    if versus and name != DEFAULT
                    else None
                ),
            )
            rows.append(row)
    return {"rows": rows, "headline": headline(rows)}


def headline(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """For each variant and concurrency its median tokens/s, ratio to plain, spread and
    verdict against the default; the best fixed k per concurrency; wrong variants."""
    variants: dict[str, dict[int, dict[str, Any]]] = {}
    for r in rows:
        variants.setdefault(r["variant"], {})[r["concurrency"]] = {
            "tokens_per_s": r["tokens_per_s"],
            "ratio_vs_plain": r["ratio_vs_plain"],
            "ratios_by_rep": r["ratios_by_rep"],
            "spread": r["spread"],
            "vs_default": r["vs_default"],
            "wrong_streams": r["wrong_streams"],
        }
    best_fixed: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["fixed_k"] is None:
            continue
        best = best_fixed.get(r["concurrency"])
        if best is None or r["tokens_per_s"] > best["tokens_per_s"]:
            best_fixed[r["concurrency"]] = {
                "variant": r["variant"],
                "tokens_per_s": r["tokens_per_s"],
                "ratio_vs_plain": r["ratio_vs_plain"],
            }
    default = variants.get(DEFAULT, {})
    return {
        "variants": variants,
        "best_fixed_k": best_fixed,
        "default_vs_plain": {c: x["ratio_vs_plain"] for c, x in default.items()},
        "default_vs_best_fixed_k": {
            c: x["tokens_per_s"] / best_fixed[c]["tokens_per_s"]
            for c, x in default.items()
            if c in best_fixed
        },
        "default_never_worse_than_plain": bool(default)
        and all(x["ratio_vs_plain"] >= NEVER_WORSE for x in default.values()),
        "wrong_variants": sorted({r["variant"] for r in rows if r["wrong_streams"]}),
    }


def _per_rep(median: float, by_rep: Sequence[float]) -> str:
    each = f" ({', '.join(f'{x:.2f}' for x in by_rep)})" if len(by_rep) > 1 else ""
    return f"{median:.2f}x{each}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _caps(row: dict[str, Any]) -> str:
    caps = row.get("k_cap_rounds") or {}
    return ", ".join(f"{cap}: {n:.0f}" for cap, n in caps.items()) or "–"


def markdown(
    summary: dict[str, Any],
    args: argparse.Namespace,
    variants: Mapping[str, Variant],
    env: dict[str, Any],
) -> str:
    h = summary["headline"]
    widest = max(args.sessions)
    lines = [
        "# Policy ablation: plain, fixed k and the full policy (with any variants), one run",
        "",
        f"Target {env['target']}, draft {env['draft']}: one target server and one draft server "
        f"({args.threads} torch threads each), one orchestrator per variant (embedded session "
        f"store), told devices = {env['devices']}. Streaming `GenerateStream` requests, greedy, "
        f"at most {args.new_tokens} new tokens each, HumanEval prompts (raw); repetition j sends "
        f"the j-th block of {widest} problems of {args.prompts[0]}-{args.prompts[-1]}, the first "
        f"c of it at c sessions, the same to every variant. {args.reps} repetitions; within "
        "each, at every concurrency the variants run back to back in the order below.",
    ]
    if args.emulate_devices:
        lines += [
            "",
            f"**Emulated devices:** every draft forward takes {args.emulate_devices[0]:g} ms "
            f"and every target forward {args.emulate_devices[1]:g} ms of device time with the "
            "CPU idle (`bench.emulated_device`).",
        ]
    lines += ["", "## Variants", "", "| name | what | orchestrator env | request |"]
    lines.append("|---|---|---|---|")
    for name, v in variants.items():
        shown = v.orchestrator_env(None)
        env_text = ", ".join(f"`{k}={val}`" for k, val in shown.items()) or "defaults"
        k = "adaptive" if v.k is None else f"k = {v.k}"
        lines.append(f"| {name} | {v.label} | {env_text} | drafter {v.drafter}, {k} |")
    lines += [
        "",
        "## Results",
        "",
        "tok/s: every stream's tokens over the wall time from the first request to the last "
        "token, median over repetitions. vs plain / vs default: median of the repetitions' "
        "ratios, each repetition's in brackets. spread: (max - min) / median of the "
        "repetitions' tok/s. verdict: `faster` / `slower` than the default in every "
        "repetition, or `within spread`. Rounds by k cap: the orchestrator's batch rounds by "
        "the cap they ran under. wrong: streams whose tokens differ from plain decoding's.",
        "",
        "| sessions | variant | tok/s | vs plain | spread | vs default | verdict | acceptance "
        "| mean acc. length | rounds by k cap | wrong |",
        "|---:|---|---:|---:|---:|---:|---|---:|---:|---|---:|",
    ]
    for r in summary["rows"]:
        vd = r["vs_default"]
        mal = r["mean_acceptance_length"]
        lines.append(
            f"| {r['concurrency']} | {r['variant']} | {r['tokens_per_s']:.2f} | "
            f"{_per_rep(r['ratio_vs_plain'], r['ratios_by_rep'])} | {_pct(r['spread'])} | "
            f"{_per_rep(vd['median'], vd['by_rep']) if vd else '–'} | "
            f"{vd['verdict'] if vd else '–'} | {_pct(r['acceptance_rate'])} | "
            f"{'–' if mal is None else f'{mal:.2f}'} | {_caps(r)} | {r['wrong_streams']} |"
        )
    lines += ["", "## Headline", ""]
    for c, best in h["best_fixed_k"].items():
        vs = h["default_vs_best_fixed_k"].get(c)
        lines.append(
            f"- At {c} session(s): the best fixed k is {best['variant']} "
            f"({best['ratio_vs_plain']:.2f}x plain); the default policy "
            f"{h['default_vs_plain'].get(c, float('nan')):.2f}x plain"
            + (f", {vs:.2f}x the best fixed k." if vs is not None else ".")
        )
    met = "**met**" if h["default_never_worse_than_plain"] else "**not met**"
    lines.append(f"- Default policy >= {NEVER_WORSE}x plain at every concurrency: {met}.")
    wrong = ", ".join(h["wrong_variants"]) or "none"
    lines.append(f"- Variants whose greedy tokens differ from plain decoding's: {wrong}.")
    eos = sum(r["eos_streams"] for r in summary["rows"])
    total = sum(r["streams"] for r in summary["rows"])
    others = env.get("others_cpu_share")
    lines += [
        "",
        f"The API cannot ignore EOS: {eos} of {total} streams ended on EOS before "
        f"{args.new_tokens} tokens (tok/s counts the tokens generated). Other processes used "
        f"{_pct(others)} of the CPUs during the run; it took {env.get('bench_minutes', 0):.0f} "
        "min.",
        "",
        "Reproduce:",
        "",
        "```",
        env["command"],
        "```",
        "",
        environment_md(env),
        f"- servers: {env['server_threads']} torch threads each; target {env['target']}, "
        f"draft {env['draft']}; devices declared to the orchestrators: {env['devices']}",
    ]
    return "\n".join(lines)
