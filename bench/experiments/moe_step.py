"""What a mixture-of-experts step costs on a CPU against a dense model of equal active
parameters.

Pairs of random float32 models (:func:`~specserve.engine.loader.random_model`) with the
same attention, one a Qwen3-MoE whose ``top_k`` experts of ``expert`` each add up to
the dense Qwen3's MLP width (so a token multiplies as many weights in both), the other
that dense Qwen3:

* ``tiny``: the test models' shape (2 layers, hidden 64, 4 heads / 2 KV heads of 16,
  vocabulary 256): 4 experts of 64, top-2, against an MLP of 128;
* ``small``: 8 layers, hidden 1024, 16 / 4 heads of 64, vocabulary 32000: 16 experts of
  256, top-4, against an MLP of 1024.

Each model prefills 64 tokens, then runs ``--steps`` one-token decode steps and as many
5-row verify steps (k = 4); the median time of each is printed, and the MoE's over the
dense model's. No model is downloaded and nothing is written.
``nice -n 19 python -m bench.experiments.moe_step --threads 2``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from specserve.engine.config import ModelConfig
from specserve.engine.loader import random_model
from specserve.engine.model import CausalLM, SeqInput

_TINY = ModelConfig(
    model_type="qwen3",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm="head",
)
_SMALL = replace(
    _TINY,
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=1024,
    num_layers=8,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
)
# shape -> (dense config, MoE config of equal active parameters)
PAIRS = {
    "tiny": (
        _TINY,
        replace(_TINY, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                expert_intermediate_size=64, norm_topk_prob=True),
    ),
    "small": (
        _SMALL,
        replace(_SMALL, model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4,
                expert_intermediate_size=256, norm_topk_prob=True),
    ),
}  # fmt: skip


def step_times(model: CausalLM, rows: int, steps: int) -> float:
    """Median seconds of a ``rows``-token forward of one session after a 64-token prefill."""
    kv = model.new_kv_pool(64 << 20)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(model.config.vocab_size, (64,), generator=gen).tolist()
    kv.reserve({"s": len(prompt)})
    model([SeqInput("s", prompt)], kv)
    times = []
    for i in range(steps + 3):
        tokens = [(7 * i + j) % model.config.vocab_size for j in range(rows)]
        kv.reserve({"s": rows})
        start = time.perf_counter()
        model([SeqInput("s", tokens, num_logits=rows)], kv)
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - start)
        kv.truncate("s", len(prompt))  # the same context every step
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--shapes", default=",".join(PAIRS), help="of: " + ", ".join(PAIRS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("shape  rows  dense ms  moe ms  moe / dense")
    for shape in args.shapes.split(","):
        dense_cfg, moe_cfg = PAIRS[shape]
        dense = random_model(dense_cfg, torch.float32)
        moe = random_model(moe_cfg, torch.float32)
        for rows in (1, 5):
            d, m = step_times(dense, rows, args.steps), step_times(moe, rows, args.steps)
            print(f"{shape:6} {rows:4}  {d * 1e3:8.2f}  {m * 1e3:6.2f}  {m / d:11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
