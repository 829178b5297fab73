"""The page of ``bench.quantized``'s results: the CPU and ISA line, the headline with
its targets, the tables (decode, prefill and memory, the forward by rows, per prompt),
llama.cpp's build and the environment; drawn from the summary
(:func:`bench.quantized_report.summarize`) alone, so a saved JSON draws the same page.

Every page opens with the CPU model and its ISA (class and extensions), whether the
AVX2 path was forced on an AVX-512 CPU (``--isa avx2``), and which llama.cpp build ran.
Every llama.cpp figure names the weight repacking it ran with (:data:`REPACK_LABELS`),
and a repacking crash is said in bold with the figures marked as the next-best.
"""

from __future__ import annotations

from typing import Any

from bench.common import environment_md
from bench.llama_cpp import REPACK_CRASHED, REPACK_OFF, REPACK_ON

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


def _repack_label(mode: str | None) -> str:
    if mode is None:
        return "–"
    return " / ".join(REPACK_LABELS.get(m, m) for m in mode.split(" / "))


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
    llama_rows = h.get("llama_forward_rows_over_one") or {}
    if llama_rows:
        cells = ", ".join(f"{r} rows {_num(x, '.2f', 'x')}" for r, x in llama_rows.items())
        lines.append(f"- llama.cpp's, same file and context: {cells}")
    return lines


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
            "| specserve ms | " + " | ".join(f"{v:.1f}" for v in curve.values()) + " |",
        ]
        # keys are ints in the run, strings once read back from the JSON file
        llama_curve = {str(r): ms for r, ms in (ll.get("forward_ms_by_rows") or {}).items()}
        if llama_curve:
            cells = (_num(llama_curve.get(str(r)), ".1f") for r in curve)
            lines.append("| llama.cpp ms | " + " | ".join(cells) + " |")
        lines += [
            "",
            f"Both after {a['pp']} cached tokens; llama.cpp's is `llama-bench -p ROWS -n 0 "
            f"-d {a['pp']}` (a batch of r tokens, as a verify), the same weights mode as its "
            "tg above.",
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
