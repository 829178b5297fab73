"""Where one quantized decode step's time goes: the matrix products against the rest.

Builds a decoder of the target's shapes (Qwen2.5 1.5B: 28 layers, hidden 1536,
intermediate 8960, 12 / 2 heads of 128, vocabulary 151936, tied LM head) holding
synthetic GGML blocks of the types llama.cpp's Q4_K_M gives each tensor (Q4_K; Q6_K for
``attn_v`` and ``ffn_down`` in the layers it gives more bits, and for the tied
embedding / LM head), fills a KV cache of ``--context`` tokens, then runs one-token
(and ``--rows``-token verify) forwards under ``torch.profiler``: per op, the CPU time
per step, so the share of the quantized products (``q8_linears``,
``q8_gate_up_silu``) against norms, attention, RoPE and Python glue shows
(``--by-op``: each layer's ops called one by one, so a layer's own products and its
attention show apart; otherwise a layer is one ``decoder_layer`` op).

No real model is loaded. ``python -m bench.experiments.quant_decode_profile --threads 2`` prints a
table per row count (nothing is written).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from dataclasses import replace

import torch
from torch import nn

from specserve.engine import cpu_kernels
from specserve.engine import model as model_module
from specserve.engine.config import ModelConfig
from specserve.engine.loader import prepare
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.quant import GGMLType, QuantizedWeight
from specserve.engine.quant.synthetic import random_weight
from specserve.engine.quantized_layers import QuantizedEmbedding, set_quantized_weight
from specserve.engine.rope import RotaryEmbedding

TARGET = ModelConfig(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    tie_word_embeddings=True,
    attention_bias=True,
    rope_theta=1e6,
)
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def q4_k_m_type(layer: int, layers: int, name: str) -> GGMLType:
    """The block type llama.cpp's Q4_K_M gives a layer's projection: Q6_K for ``v`` and
    ``down`` in the first and last eighth of the layers and every third between."""
    eighth = layers // 8
    more_bits = layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2
    return GGMLType.Q6_K if name in ("v_proj", "down_proj") and more_bits else GGMLType.Q4_K


def synthetic_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """A decoder of ``cfg``'s shapes with Q4_K_M-typed random blocks (no float32 copy),
    prepared to serve (:func:`~specserve.engine.loader.prepare`)."""
    with torch.device("meta"):
        model = CausalLM(cfg).eval()
    scales = (1e-5, 2e-3)  # small enough that activations stay finite through the layers
    for i, layer in enumerate(model.model.layers):
        for parent, names in ((layer.self_attn, _ATTN), (layer.mlp, _MLP)):
            for name in names:
                proj: nn.Linear = getattr(parent, name)
                t = q4_k_m_type(i, cfg.num_layers, name)
                w = random_weight(t, proj.out_features, proj.in_features, seed + 10 * i, scales)
                set_quantized_weight(proj, w)
    embedding = random_weight(GGMLType.Q6_K, cfg.vocab_size, cfg.hidden_size, seed + 1, scales)
    model.model.embed_tokens = QuantizedEmbedding(embedding)
    set_quantized_weight(model.lm_head, embedding)
    model.to_empty(device="cpu")  # norms and biases
    model.rope = RotaryEmbedding(cfg)  # its tables were made on the meta device
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.01)
    return prepare(model)  # as the loader leaves a served model: weights on huge pages


def _quantized_bytes(model: CausalLM) -> int:
    seen = {
        id(m.weight): m.weight.nbytes
        for m in model.modules()
        if isinstance(getattr(m, "weight", None), QuantizedWeight)
    }
    return sum(seen.values())


def profile(model: CausalLM, rows: int, context: int, steps: int) -> list[tuple[str, float]]:
    """(op, ms per step) over ``steps`` forwards of ``rows`` new tokens, slowest first;
    the ``total`` entry is the forward's wall time."""
    kv = model.new_kv_pool((context + rows * (steps + 2) + 64) * model.config.kv_bytes_per_token)
    kv.reserve({"s": context + rows * (steps + 2)})
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (context,), generator=gen).tolist()
    for at in range(0, context, 32):  # kernel-sized chunks: no whole-matrix dequantization
        model([SeqInput("s", ids[at : at + 32], num_logits=1)], kv)
    model([SeqInput("s", ids[:rows], num_logits=rows)], kv)  # warm-up
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            model([SeqInput("s", ids[:rows], num_logits=rows)], kv)
        wall = (time.perf_counter() - start) / steps * 1e3
    per_op: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        per_op[evt.key] += evt.self_cpu_time_total / 1e3 / steps
    ranked = sorted(per_op.items(), key=lambda kv_: -kv_[1])
    return [("total (wall)", wall), *ranked]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,5", help="new tokens per forward, comma list")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=TARGET.num_layers)
    p.add_argument("--top", type=int, default=12)
    p.add_argument(
        "--by-op",
        action="store_true",
        help="run each layer's ops one by one instead of the layer as one op, so the "
        "table splits a layer into its products, attention and the rest",
    )
    args = p.parse_args(argv)
    if args.by_op:  # the forward asks model.layer_kernels whether a layer may run as one op
        model_module.layer_kernels = lambda _h, _k: None
    if cpu_kernels.kernels() is None:
        print("the CPU kernels are not available here: nothing to profile", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    cfg = replace(TARGET, num_layers=args.layers)
    model = synthetic_model(cfg)
    print(f"quantized weights: {_quantized_bytes(model) / 2**20:.0f} MiB, {cfg.num_layers} layers")
    for rows in (int(r) for r in args.rows.split(",")):
        table = profile(model, rows, args.context, args.steps)
        wall = table[0][1]
        products = sum(ms for op, ms in table if "q8_" in op)
        print(f"\n{rows} row(s): {wall:.1f} ms per forward; quantized products {products:.1f} ms "
              f"({100 * products / wall:.0f}%), the rest {wall - products:.1f} ms")  # fmt: skip
        print("| op | ms per forward |\n| --- | ---: |")
        for op, ms in table[1 : args.top + 1]:
            print(f"| {op} | {ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
