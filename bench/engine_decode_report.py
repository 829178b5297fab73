"""The figures, markdown, JSON and plot of :mod:`bench.engine_decode`.

:class:`Measured` holds what one run measured; :func:`report` turns it into the
markdown table and the JSON data of ``bench/results/NAME.{md,json}`` (medians,
ratios to the memory floor and to the engine, whether the greedy tokens agree, the
issue's three targets); :func:`plot` draws each variant's forward cost relative to
one token into ``NAME.png``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import Samples, environment_md
from bench.engine_decode_measure import FORWARD_SIZES, PAGE_AB_LAYERS, Decode
from bench.engine_decode_models import ENGINE, HF, HF_HUGE


@dataclass
class Measured:
    """Everything one run measured, as the report needs it."""

    model: str  # the model directory's (or file's) name
    huge_pages: bool
    moved_bytes: int  # weight bytes moved onto huge pages after loading
    floor_bytes: int  # weight bytes read per token
    bandwidth: Samples  # streaming read, bytes/s, sampled between the decode runs
    bandwidth_4k: Samples  # the same read on 4 KiB pages
    runs: dict[str, list[Decode]]  # variant -> one decode per prompt (engine first)
    costs: dict[str, dict[int, Samples]]  # variant -> new tokens -> forward seconds
    pages: dict[str, Samples]  # "huge pages" / "4 KiB pages" -> product seconds ({}: not run)
    page_bytes: int
    load_before: tuple[float, float, float] | None
    load_after: tuple[float, float, float] | None
    others: float | None  # CPU share of other processes during the run


def ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.0%}"


def _load(avg: tuple[float, float, float] | None) -> str:
    return "n/a" if avg is None else "/".join(f"{x:.2f}" for x in avg)


def first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ; None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def relative(costs: dict[str, dict[int, Samples]]) -> dict[str, dict[int, float]]:
    """Each variant's forward cost relative to its 1-token forward."""
    return {
        name: {n: by_n[n].median / by_n[1].median for n in sorted(by_n)}
        for name, by_n in costs.items()
    }


def _targets(floor_s: float, per_token: dict[str, float], rel: dict[str, dict[int, float]]) -> str:
    """The issue's three targets, each with the figure measured in this run."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    eng = per_token[ENGINE]
    ref_name = HF if HF in per_token else HF_HUGE
    ref = per_token[ref_name]
    lines = [
        f"- engine decode <= 1.15x the memory floor: {eng / floor_s:.2f}x, "
        f"{verdict(eng / floor_s <= 1.15)}.",
        f"- engine >= 1.25x faster than `{ref_name}`: {ref / eng:.2f}x, "
        f"{verdict(ref / eng >= 1.25)}. transformers' own decode runs at "
        f"{ref / floor_s:.2f}x the floor here, so at batch 1 in float32 no engine can be "
        f"more than {ref / floor_s:.2f}x faster than it: both are bound by reading the "
        "weights.",
    ]
    if 5 in rel[ENGINE]:
        others = ", ".join(f"{n} {rel[n][5]:.2f}x" for n in rel if n != ENGINE)
        lines.append(
            f"- a 5-token forward <= 2.5x a 1-token one: engine {rel[ENGINE][5]:.2f}x, "
            f"{verdict(rel[ENGINE][5] <= 2.5)} ({others})."
        )
    return "\n".join(lines)


def plot(rel: dict[str, dict[int, float]], path: Path) -> bool:
    """Forward cost relative to 1 token, per variant; returns whether a plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, by_n in rel.items():
        ns = sorted(by_n)
        ax.plot(ns, [by_n[n] for n in ns], marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("new tokens in one forward (200-token cache)")
    ax.set_ylabel("time relative to 1 token")
    ax.set_title("Qwen2.5-Coder-1.5B float32, 2 threads: cost by token count")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(
    m: Measured,
    args: argparse.Namespace,
    env: dict[str, Any],
    cmd: str,
    plot_name: str | None,
) -> tuple[str, dict[str, Any]]:
    """The results file's markdown and JSON data; ``plot_name``: the PNG beside it, if any."""
    names = list(m.runs)
    runs, costs, pages, page_bytes = m.runs, m.costs, m.pages, m.page_bytes
    bandwidth, bandwidth_4k, floor_bytes = m.bandwidth, m.bandwidth_4k, m.floor_bytes
    huge = m.huge_pages
    bw = bandwidth.median
    floor_s = floor_bytes / bw
    per_token = {n: statistics.median(r.per_token_s for r in runs[n]) for n in names}
    mean = {n: statistics.median(r.mean_s for r in runs[n]) for n in names}
    prefill = {n: statistics.median(r.prefill_s for r in runs[n]) for n in names}
    eng = per_token[ENGINE]
    diffs = {
        n: [first_diff(a.tokens, b.tokens) for a, b in zip(runs[ENGINE], runs[n], strict=True)]
        for n in names
        if n != ENGINE
    }
    rel = relative(costs)
    step1, prod1 = costs[ENGINE][1].median, costs["products"][1].median
    decode_rows = [
        f"| {n} | {ms(per_token[n])} | {per_token[n] / floor_s:.2f}x | {1 / per_token[n]:.2f} "
        f"| {per_token[n] / eng:.2f}x | {ms(mean[n])} | {ms(prefill[n])} |"
        for n in names
    ]
    same = "; ".join(
        f"{n}: {sum(d is None for d in ds)} of {len(ds)} prompts"
        + ("" if all(d is None for d in ds) else f" (first differing position: {ds})")
        for n, ds in diffs.items()
    )
    targets_md = _targets(floor_s, per_token, rel)
    header = "| | " + " | ".join(f"n = {n}" for n in FORWARD_SIZES) + " |"
    rule = "|---|" + "---:|" * len(FORWARD_SIZES)
    fwd_rows = []
    for name, by_n in costs.items():
        cells = " | ".join(f"{ms(by_n[n].median)} ({rel[name][n]:.2f}x)" for n in FORWARD_SIZES)
        fwd_rows.append(f"| {name} | {cells} |")
    page_md = ""
    if pages:
        hp, sp = pages["huge pages"].median, pages["4 KiB pages"].median
        page_md = (
            "\n## Weights on huge pages vs 4 KiB pages\n\n"
            f"1-row products of the first {PAGE_AB_LAYERS} layers ({page_bytes / 1e6:.0f} MB): "
            f"the engine's huge-page weights {ms(hp)} ms ({page_bytes / hp / 1e9:.1f} GB/s), "
            f"a copy on 4 KiB pages {ms(sp)} ms ({page_bytes / sp / 1e9:.1f} GB/s); "
            f"**{sp / hp:.2f}x** from the page size alone ({args.reps} interleaved rounds).\n"
        )
    md = f"""# Engine decode: target-only speed, memory floor, transformers

Qwen2.5-Coder-1.5B-Instruct (`{m.model}`, dequantized from the Q4_K_M GGUF),
float32 weights and KV cache, {args.threads} threads, greedy, batch 1, one process.
`{ENGINE}`: weights on huge pages ({m.moved_bytes / 1e9:.2f} GB moved after loading).
`{HF}`: `generate` as `from_pretrained` loads it (4 KiB pages).
`{HF_HUGE}`: `generate` over the engine's own weight tensors (shared, not copied).

## Decode: HumanEval 0-{len(runs[ENGINE]) - 1}, raw prompt, {args.new_tokens} new tokens each

Streaming read bandwidth **{bw / 1e9:.1f} GB/s**; weight bytes read per token
{floor_bytes / 1e9:.3f} GB; memory floor **{ms(floor_s)} ms/token**
({1 / floor_s:.2f} tokens/s).

| | ms/token | vs floor | tokens/s | vs engine | mean ms/token | prefill ms |
|---|---:|---:|---:|---:|---:|---:|
{chr(10).join(decode_rows)}

- ms/token: median over prompts of each prompt's median step (one-token forward +
  argmax); "mean": first to last new token over the steps, median over prompts;
  prefill: prompt forward to the first token, median over prompts.
- greedy tokens identical to the engine's: {same}.
- bandwidth: `torch.amax` over a 1 GiB float32 buffer on {"huge" if huge else "4 KiB"} pages,
  median of {len(bandwidth.times)} samples taken between the decode runs (quartiles
  {bandwidth.spread[0] / 1e9:.1f}-{bandwidth.spread[1] / 1e9:.1f} GB/s); the same read on
  4 KiB pages: {bandwidth_4k.median / 1e9:.1f} GB/s.
- a 1-token step with a {args.context}-token cache (table below): the matrix products alone
  take {ms(prod1)} ms ({floor_bytes / prod1 / 1e9:.1f} GB/s), the whole forward
  {ms(step1)} ms; the other {ms(step1 - prod1)} ms are attention, norms, the KV cache and
  Python.

## Against the targets of the issue

{targets_md}

## One forward of n new tokens after a {args.context}-token cache

ms, median of {args.reps} interleaved rounds, logits for all n tokens (as a verify step);
in brackets: relative to n = 1. `{ENGINE}-torch`: the engine with its CPU kernels off
(torch ops only). `products`: the step's matrix products alone (qkv, o, gate/up, down
per layer, LM head), with the kernels and with torch.

{header}
{rule}
{chr(10).join(fwd_rows)}

{"![forward cost](" + plot_name + ")" if plot_name else ""}
{page_md}
## Environment

{environment_md(env)}
- machine load: other processes used {_pct(m.others)} of the CPUs' time during the run
  (busy CPU time minus this benchmark's own); load average (1/5/15 min, this run's
  threads included) before {_load(m.load_before)}, after {_load(m.load_after)}. The machine
  is shared with other jobs, so absolute times move between runs; the ratios within
  this run are what the table claims.
- model files: `{m.model}/` safetensors (float32), its tokenizer.

Reproduce (from the repository root):

```
{cmd}
```
"""
    data = {
        "environment": env,
        "args": vars(args),
        "model": m.model,
        "huge_pages": huge,
        "moved_bytes": m.moved_bytes,
        "load_average_before": m.load_before,
        "load_average_after": m.load_after,
        "other_processes_cpu_share": m.others,
        "bandwidth_bytes_per_s": bandwidth,
        "bandwidth_4k_bytes_per_s": bandwidth_4k,
        "floor_bytes_per_token": floor_bytes,
        "floor_s_per_token": floor_s,
        "decode": {n: [asdict(r) for r in runs[n]] for n in names},
        "decode_s_per_token": per_token,
        "decode_mean_s_per_token": mean,
        "first_diff": diffs,
        "forward": {name: {str(n): s for n, s in by_n.items()} for name, by_n in costs.items()},
        "forward_relative": rel,
        "page_size": {"bytes": page_bytes, **pages},
        "command": cmd,
    }
    return md, data
