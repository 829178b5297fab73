"""The results of ``bench.quantized``: the summary, ``headline`` first (its page is
:mod:`bench.quantized_page`).

Speeds are totals (tokens / seconds over all prompts) per variant, and decode speeds
as llama.cpp measures its own: from the end of the first round (the prompt's prefill
and the first token) to the last token (``llama-speculative``'s ``decoded`` line
likewise starts after the prompt); the end-to-end figure, prefill included, is kept
beside it. llama.cpp's
target figure is ``llama-bench``'s tg (mean of its repetitions, averaged over the runs
before and after the prompts): generation from an empty context, a little easier than
the prompts' 50-200 tokens of context, so the ratios against it are conservative for
specserve. The targets (:data:`TARGETS`, issue 44's): specserve target-only >= 1.05x
llama.cpp's target tg; adaptive speculation >= 1.3x specserve target-only and >= 1.4x
llama.cpp's tg, never below target-only on a prompt of either class (code, prose);
prefill >= 1.0x llama.cpp's pp; a forward of 5 new tokens <= 1.3x one, of 9 <= 1.8x.

The headline carries the CPU model and its ISA and whether the AVX2 path was forced on
an AVX-512 CPU (``--isa avx2``); every llama.cpp figure keeps the weight repacking it
ran with.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bench.common import reproduce_command
from bench.llama_cpp import REPACK_MODES

if TYPE_CHECKING:
    from bench.quantized import Prompt, Variant

# (headline key, a dotted path for a nested one; comparison; goal)
TARGETS = (
    ("target_only_over_llama_tg", ">=", 1.05),
    ("adaptive_over_target_only", ">=", 1.3),
    ("adaptive_over_llama_tg", ">=", 1.4),
    ("adaptive_worst_prompt_over_target_only.code", ">=", 1.0),
    ("adaptive_worst_prompt_over_target_only.prose", ">=", 1.0),
    ("prefill_over_llama_pp", ">=", 1.0),
    ("forward_rows_over_one.5", "<=", 1.3),
    ("forward_rows_over_one.9", "<=", 1.8),
)
ADAPTIVE = "specserve speculative k=auto"  # bench.quantized's name of adaptive k


def _modes(modes: Sequence[str]) -> str | None:
    """The repacking modes of several runs, in :data:`REPACK_MODES` order, " / " between;
    None for no runs."""
    seen = [m for m in REPACK_MODES if m in modes]
    return " / ".join(seen) or None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _variant_row(v: Variant) -> dict[str, Any]:
    tokens = sum(len(t) for t in v.tokens)
    return {
        "variant": v.name,
        "tokens_per_s": sum(v.decode_tokens) / max(sum(v.decode_seconds), 1e-9),
        "end_to_end_tokens_per_s": tokens / sum(v.seconds),
        "acceptance_rate": v.accepted / v.drafted if v.drafted else None,
        "mean_drafted_per_round": v.drafted / v.rounds if v.rounds else None,
        "mean_acceptance_length": 1 + v.accepted / v.rounds if v.rounds and v.drafted else None,
        "drafted": v.drafted,
        "accepted": v.accepted,
        "wrong_prompts": v.wrong,
    }


def _llama_bench(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per role: each test's tokens/s averaged over the runs, and the peak RSS."""
    out: dict[str, Any] = {}
    for role in runs[0] if runs else []:
        tests: dict[str, list[float]] = {}
        for run in runs:
            for name, fig in run[role].figures.items():
                tests.setdefault(name, []).append(fig.tokens_per_s)
        out[role] = {
            "tokens_per_s": {name: statistics.mean(ts) for name, ts in tests.items()},
            "runs": {name: ts for name, ts in tests.items()},
            "peak_rss_bytes": max(run[role].peak_rss_bytes for run in runs),
            "info": runs[0][role].info,
            "repack": _modes([run[role].repack for run in runs]),
        }
    return out


def _llama_speculative(runs: list[Any]) -> dict[str, Any] | None:
    if not runs:
        return None
    drafted = sum(r.drafted for r in runs)
    return {
        "tokens_per_s": sum(r.tokens for r in runs) / sum(r.decode_s for r in runs),
        "prefill_tokens_per_s": sum(r.prompt_tokens for r in runs) / sum(r.prefill_s for r in runs),
        "acceptance_rate": sum(r.accepted for r in runs) / drafted if drafted else None,
        "peak_rss_bytes": max(r.peak_rss_bytes for r in runs),
        "repack": _modes([r.repack for r in runs]),
    }


def summarize(
    args: argparse.Namespace,
    prompts: Sequence[Prompt],
    variants: Sequence[Variant],
    llama: dict[str, Any],
    prefill: dict[str, float],
    curve: dict[int, float],
    rss: dict[str, int],
    env: dict[str, Any],
) -> dict[str, Any]:
    """Everything the page and the JSON file hold; ``headline`` carries the ratios."""
    rows = [_variant_row(v) for v in variants]
    target_only, speculative = rows[0], rows[1:]
    best = max(speculative, key=lambda r: r["tokens_per_s"], default=None)
    bench = _llama_bench(llama["bench"])
    spec = _llama_speculative(llama["speculative"])
    tg = bench.get("target", {}).get("tokens_per_s", {}).get(f"tg{args.new_tokens}")
    pp = bench.get("target", {}).get("tokens_per_s", {}).get(f"pp{args.pp}")
    best_tps = best["tokens_per_s"] if best else None
    headline: dict[str, Any] = {
        "cpu": env.get("cpu"),
        "isa": env.get("isa_measured", env.get("isa")),
        "cpu_isa": env.get("isa"),
        "isa_forced": bool(env.get("isa_forced")),
        "llama_tg_target_repack": bench.get("target", {}).get("repack"),
        "llama_tg_target_tokens_per_s": tg,
        "specserve_target_only_tokens_per_s": target_only["tokens_per_s"],
        "target_only_over_llama_tg": _ratio(target_only["tokens_per_s"], tg),
        "best_speculative": best["variant"] if best else None,
        "best_speculative_tokens_per_s": best_tps,
        "best_speculative_over_llama_tg": _ratio(best_tps, tg),
        "llama_speculative_tokens_per_s": spec["tokens_per_s"] if spec else None,
        "best_speculative_over_llama_speculative": _ratio(best_tps, spec and spec["tokens_per_s"]),
        "prefill": {
            "specserve_target_tokens_per_s": prefill["target"],
            "llama_pp_target_tokens_per_s": pp,
            "specserve_over_llama": _ratio(prefill["target"], pp),
        },
        "rss_bytes": {
            "llama_bench_target_peak": bench.get("target", {}).get("peak_rss_bytes"),
            "llama_speculative_peak": spec["peak_rss_bytes"] if spec else None,
            "specserve_target_loaded": rss["target_loaded"],
            "specserve_models_loaded": rss["target_and_draft_loaded"],
            "specserve_kv_budget": rss["kv_budget"],
            "specserve_peak": rss["peak"],
        },
        "greedy_speculative_equals_target_only": all(not r["wrong_prompts"] for r in speculative),
        "drafts_accepted": sum(r["accepted"] for r in speculative),
    }
    per_prompt = []
    for i, prompt in enumerate(prompts):
        cell: dict[str, Any] = {"prompt": prompt.label, "prompt_tokens": len(prompt.ids)}
        if i < len(llama["speculative"]):
            run = llama["speculative"][i]
            cell["llama_speculative"] = {
                "tokens_per_s": run.tokens_per_s,
                "acceptance_rate": run.acceptance_rate,
            }
        for v in variants:
            cell[v.name] = v.decode_tokens[i] / max(v.decode_seconds[i], 1e-9)
        per_prompt.append(cell)
    headline.update(_adaptive_ratios(rows, per_prompt, tg))
    headline["prefill_over_llama_pp"] = headline["prefill"]["specserve_over_llama"]
    headline["forward_rows_over_one"] = {
        str(r): ms / curve[1] for r, ms in curve.items() if 1 in curve and r != 1
    }
    llama_curve = llama.get("forward_ms_by_rows") or {}
    headline["llama_forward_rows_over_one"] = {
        str(r): ms / llama_curve[1] for r, ms in llama_curve.items() if 1 in llama_curve and r != 1
    }
    headline["targets"] = {
        f"{key} {op} {goal}": _judge(headline, key, op, goal) for key, op, goal in TARGETS
    }
    return {
        "headline": headline,
        "specserve": {
            "variants": rows,
            "prefill_tokens_per_s": prefill,
            "forward_ms_by_rows": curve,
            "rss_bytes": rss,
        },
        "llama_cpp": {
            "skipped": llama["skipped"],
            "build": llama.get("build"),
            "repack_disabled": llama.get("repack_disabled", False),
            "repack_crashed": dict(llama.get("repack_crashed", {})),
            "bench": bench,
            "forward_ms_by_rows": llama_curve,
            "speculative": spec,
        },
        "per_prompt": per_prompt,
        # a path of this machine: its last part only
        "args": {k: v.name if k == "llama_cpp" and v else v for k, v in vars(args).items()},
        "reproduce": reproduce_command("bench.quantized"),
        "environment": env,
    }


def _adaptive_ratios(
    rows: list[dict[str, Any]], per_prompt: list[dict[str, Any]], tg: float | None
) -> dict[str, Any]:
    """Adaptive k against target-only and llama.cpp's tg, and its worst prompt of each
    class (prose: the prose prompts; code: the others) against target-only."""
    by = {r["variant"]: r for r in rows}
    adaptive, plain = by.get(ADAPTIVE), rows[0]
    worst: dict[str, float | None] = {"code": None, "prose": None}
    for cell in per_prompt:
        if ADAPTIVE not in cell:
            continue
        cls = "prose" if cell["prompt"].startswith("prose") else "code"
        ratio = cell[ADAPTIVE] / cell[plain["variant"]]
        worst[cls] = ratio if worst[cls] is None else min(worst[cls], ratio)  # type: ignore[type-var]
    tps = adaptive["tokens_per_s"] if adaptive else None
    return {
        "adaptive_over_target_only": _ratio(tps, plain["tokens_per_s"]),
        "adaptive_over_llama_tg": _ratio(tps, tg),
        "adaptive_worst_prompt_over_target_only": worst,
    }


def _judge(headline: dict[str, Any], key: str, op: str, goal: float) -> bool | None:
    """Whether the headline's figure at ``key`` (dotted: nested) meets ``op goal``; None
    where it was not measured."""
    value: Any = headline
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return None
    return value >= goal if op == ">=" else value <= goal
