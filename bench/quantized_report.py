"""The results of ``bench.quantized``: the summary (``headline`` first) and its page.

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

Every page opens with the CPU model and its ISA (class and extensions), whether the
AVX2 path was forced on an AVX-512 CPU (``--isa avx2``), and which llama.cpp build ran;
every llama.cpp figure names the weight repacking it ran with (:data:`REPACK_LABELS`),
and a repacking crash is said in bold with the figures marked as the next-best.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bench.common import environment_md, reproduce_command
from bench.llama_cpp import REPACK_CRASHED, REPACK_MODES, REPACK_OFF, REPACK_ON

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
GIB = float(1 << 30)
# How each llama.cpp figure ran, in the tables.
REPACK_LABELS = {
    REPACK_ON: "weights repacked (llama.cpp's default)",
    REPACK_OFF: "weights as stored (--llama-no-repack)",
    REPACK_CRASHED: "weights as stored: repacking crashed, next-best",
}
# Which llama.cpp build ran (the "build" of bench.quantized's llama side).
BUILD_LABELS = {
    "native": "scripts/build-llama-cpp.sh's native build (GGML_NATIVE: this machine's ISA)",
    "avx2": "scripts/build-llama-cpp.sh's AVX2-only build (LLAMA_ISA=avx2: AVX2 + FMA + "
    "F16C, no AVX-512, no AMX)",
    "given": "the binaries of --llama-cpp",
}


def _modes(modes: Sequence[str]) -> str | None:
    """The repacking modes of several runs, in :data:`REPACK_MODES` order, " / " between;
    None for no runs."""
    seen = [m for m in REPACK_MODES if m in modes]
    return " / ".join(seen) or None


def _repack_label(mode: str | None) -> str:
    if mode is None:
        return "–"
    return " / ".join(REPACK_LABELS.get(m, m) for m in mode.split(" / "))


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


def _adaptive_lines(h: dict[str, Any]) -> list[str]:
    """The headline's lines on adaptive speculation and the forward's cost by rows."""
    lines = []
    if h.get("adaptive_over_target_only") is not None:
        worst = h["adaptive_worst_prompt_over_target_only"]
        lines.append(
            f"- adaptive speculation: **{_num(h['adaptive_over_target_only'], '.2f', 'x')}** "
            f"specserve target-only, {_num(h['adaptive_over_llama_tg'], '.2f', 'x')} llama.cpp's "
            f"target tg; its worst prompt {_num(worst['code'], '.2f', 'x')} target-only (code), "
            f"{_num(worst['prose'], '.2f', 'x')} (prose)"
        )
    rows = h.get("forward_rows_over_one") or {}
    if rows:
        cells = ", ".join(f"{r} rows {_num(x, '.2f', 'x')}" for r, x in rows.items())
        lines.append(f"- target forward by new tokens, against one: {cells}")
    return lines


def _judge(headline: dict[str, Any], key: str, op: str, goal: float) -> bool | None:
    """Whether the headline's figure at ``key`` (dotted: nested) meets ``op goal``; None
    where it was not measured."""
    value: Any = headline
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return None
    return value >= goal if op == ">=" else value <= goal


def _num(x: float | None, fmt: str = ".2f", unit: str = "") -> str:
    return "–" if x is None else f"{x:{fmt}}{unit}"


def _gib(x: int | None) -> str:
    return "–" if x is None else f"{x / GIB:.2f} GiB"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def isa_line(result: dict[str, Any]) -> str:
    """The page's first sentence: the CPU model, its ISA in words and class, which path
    specserve's kernels took (the AVX2 path forced on an AVX-512 CPU said as such), and
    which llama.cpp build ran."""
    env, ll = result["environment"], result["llama_cpp"]
    cpu = f"{env.get('cpu', 'unknown CPU')}, {env.get('isa_description', '?')}"
    line = f"CPU: **{cpu}** (ISA class {env.get('isa', '?')})"
    kernels = env.get("specserve_kernels_isa", "?")
    if env.get("isa_forced"):
        line += (
            f". **AVX2 path forced on an AVX-512 CPU** (`--isa avx2`): specserve's kernels "
            f"with SPECSERVE_CPU_ISA={env.get('specserve_cpu_isa_env')} (torch's own ops "
            f"at its CPU capability, {env.get('torch_cpu_capability', '?')})"
        )
    else:
        line += f"; specserve's kernels: {kernels}"
    build = ll.get("build")
    if ll.get("skipped") or build is None:
        line += "; llama.cpp not run."
    else:
        line += f"; llama.cpp: {BUILD_LABELS.get(build, build)}."
    return line


def markdown(result: dict[str, Any]) -> str:
    """The results page: the CPU and ISA line (:func:`isa_line`) at its top, then the
    headline, the tables, and the environment."""
    h, s, ll, a = result["headline"], result["specserve"], result["llama_cpp"], result["args"]
    met = {True: "met", False: "**not met**", None: "not measured"}
    lines = [
        "# specserve vs llama.cpp on the same GGUF files",
        "",
        isa_line(result),
        "",
        f"Target {a['target']} ({a['target_dtype']} compute), draft {a['draft']} "
        f"({a['draft_dtype']}); {a['threads']} threads each side; HumanEval prompts "
        f"{a['prompts']} (raw) and {a['prose']} prose prompts (chat template), "
        f"{a['new_tokens']} new tokens, greedy, end of generation ignored; per prompt "
        "llama-speculative and the specserve variants run in turn, in one process. "
        "llama.cpp tg is `llama-bench` from an empty context (mean of the runs before and "
        "after the prompts). Speeds are tokens / seconds over all prompts, after the "
        "first round (prefill and first token) as llama.cpp's own figures; end-to-end "
        "includes the prompt's prefill.",
        "",
    ]
    if ll["skipped"]:
        lines += [f"**{ll['skipped']}.**", ""]
    crashed = ll.get("repack_crashed") or {}
    if crashed:
        which = "; ".join(
            f"{key} ({fail.splitlines()[0].rstrip(':')})" for key, fail in crashed.items()
        )
        lines += [
            f"**llama.cpp's weight repacking crashed**: {which}. Each crashed run was run "
            "once more with repacking off; those figures are the next-best (llama.cpp "
            "multiplying the GGUF blocks as stored), marked so below.",
            "",
        ]
    elif ll.get("repack_disabled"):
        lines += [
            "llama.cpp ran with weight repacking off (`--llama-no-repack`), not as its "
            "users run it by default.",
            "",
        ]
    lines += [
        "## Headline",
        "",
        f"- specserve target-only: **{_num(h['specserve_target_only_tokens_per_s'])} tok/s**; "
        f"llama.cpp target tg: {_num(h['llama_tg_target_tokens_per_s'])} tok/s -> "
        f"**{_num(h['target_only_over_llama_tg'], '.2f', 'x')}**",
        f"- specserve best speculative ({h['best_speculative']}): "
        f"**{_num(h['best_speculative_tokens_per_s'])} tok/s** -> "
        f"**{_num(h['best_speculative_over_llama_tg'], '.2f', 'x')}** llama.cpp's target tg; "
        f"llama-speculative {_num(h['llama_speculative_tokens_per_s'])} tok/s -> "
        f"{_num(h['best_speculative_over_llama_speculative'], '.2f', 'x')}",
        *_adaptive_lines(h),
        f"- prefill ({a['pp']} tokens, target): specserve "
        f"{_num(h['prefill']['specserve_target_tokens_per_s'], '.1f')} tok/s, llama.cpp pp "
        f"{_num(h['prefill']['llama_pp_target_tokens_per_s'], '.1f')} tok/s -> "
        f"{_num(h['prefill']['specserve_over_llama'], '.2f', 'x')}",
        f"- greedy speculative == target-only on every prompt: "
        f"**{'yes' if h['greedy_speculative_equals_target_only'] else 'NO'}** "
        f"({h['drafts_accepted']} drafts accepted)",
        *[f"- target {key}: {met[value]}" for key, value in h["targets"].items()],
        "",
        "## Decode",
        "",
        "| variant | tok/s | end-to-end tok/s | acceptance | mean drafted / round "
        "| mean acc. length | wrong | llama.cpp weights |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    spec = ll["speculative"]
    spec_mode = _repack_label(spec.get("repack")) if spec else "–"
    if spec:
        lines.append(
            f"| llama-speculative (draft max {a['draft_max']}) | {spec['tokens_per_s']:.2f} | "
            f"– | {_pct(spec['acceptance_rate'])} | {a['draft_max']} | – | – | {spec_mode} |"
        )
    for role, b in ll["bench"].items():
        mode = _repack_label(b.get("repack"))
        for test, tps in b["tokens_per_s"].items():
            lines.append(f"| llama-bench {role} {test} | {tps:.2f} | – | – | – | – | – | {mode} |")
    for r in s["variants"]:
        lines.append(
            f"| {r['variant']} | {r['tokens_per_s']:.2f} | "
            f"{r['end_to_end_tokens_per_s']:.2f} | {_pct(r['acceptance_rate'])} | "
            f"{_num(r['mean_drafted_per_round'])} | {_num(r['mean_acceptance_length'])} | "
            f"{r['wrong_prompts'] or 'none'} | – |"
        )
    lines += [
        "",
        "## Prefill and memory",
        "",
        "| | specserve | llama.cpp | llama.cpp weights |",
        "|---|---:|---:|---|",
    ]
    for role in ("target", "draft"):
        b = ll["bench"].get(role, {})
        pp = b.get("tokens_per_s", {}).get(f"pp{a['pp']}")
        lines.append(
            f"| prefill {role}, {a['pp']} tokens (tok/s) | "
            f"{s['prefill_tokens_per_s'][role]:.1f} | {_num(pp, '.1f')} | "
            f"{_repack_label(b.get('repack'))} |"
        )
    rss, hr = s["rss_bytes"], h["rss_bytes"]
    bench_mode = _repack_label(ll["bench"].get("target", {}).get("repack"))
    lines += [
        f"| resident, target alone | {_gib(rss['target_loaded'])} (process after loading "
        f"it; {_gib(rss['before_load'])} before) | {_gib(hr['llama_bench_target_peak'])} "
        f"(llama-bench peak) | {bench_mode} |",
        f"| resident, target + draft | {_gib(rss['target_and_draft_loaded'])} (process after "
        f"loading both) | {_gib(hr['llama_speculative_peak'])} (llama-speculative peak) | "
        f"{spec_mode} |",
        f"| resident, target + draft + KV caches | {_gib(rss['peak'])} (process peak; KV "
        f"pools {_gib(rss['kv_budget'])}) | {_gib(hr['llama_speculative_peak'])} "
        f"(context {a['llama_ctx']} tokens) | {spec_mode} |",
        "",
        "specserve's figures are this benchmark's own process (the local loop, both models "
        "in one process, plus the Python, torch and tokenizer it needs); its KV pools are "
        "`generate --local`'s budgets, allocated and zeroed whole when the engine is built. "
        "llama.cpp's are each tool's peak RSS. Both count the memory-mapped GGUF pages "
        "they touched.",
        "",
        "## Target forward cost by new tokens (verify of k drafts = k + 1 rows)",
        "",
    ]
    curve = s["forward_ms_by_rows"]
    if curve:
        lines += [
            "| rows | " + " | ".join(str(r) for r in curve) + " |",
            "|---|" + "---:|" * len(curve),
            "| ms | " + " | ".join(f"{v:.1f}" for v in curve.values()) + " |",
        ]
    else:
        lines.append("Not measured: the curve was skipped (`--curve-rows ''`).")
    lines += [
        "",
        "## Per prompt (tok/s)",
        "",
    ]
    names = [r["variant"] for r in s["variants"]]
    lines += [
        "| prompt | tokens | llama-speculative | llama acceptance | " + " | ".join(names) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(names),
    ]
    for c in result["per_prompt"]:
        lc = c.get("llama_speculative", {})
        lines.append(
            f"| {c['prompt']} | {c['prompt_tokens']} | {_num(lc.get('tokens_per_s'))} | "
            f"{_pct(lc.get('acceptance_rate'))} | "
            + " | ".join(f"{c[n]:.2f}" for n in names)
            + " |"
        )
    info = ll["bench"].get("target", {}).get("info")
    if info:
        build = BUILD_LABELS.get(ll.get("build") or "native", ll.get("build"))
        lines += [
            "",
            f"llama.cpp: {build}, CPU backend, Release; as llama-bench reports it: "
            + ", ".join(f"{k} {v}" for k, v in info.items()),
        ]
    lines += ["", "Reproduce:", "", "```", result["reproduce"], "```", ""]
    env = result["environment"]
    forced = " (forced by SPECSERVE_CPU_ISA)" if env.get("specserve_cpu_isa_env") else ""
    lines += [
        environment_md(env),
        f"- ISA: {env.get('isa_description')} (class {env.get('isa')}); measured as "
        f"{env.get('isa_measured', env.get('isa'))}",
        f"- specserve kernels: {env.get('specserve_kernels_isa')}{forced}",
    ]
    return "\n".join(lines)
