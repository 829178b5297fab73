"""Matrix products of quantized weights against float32 and bfloat16, on the target's shapes.

For each weight shape of the Qwen2.5 1.5B target and 0.5B draft (q/o, k/v, gate/up,
down) and each row count (1, 4, 8, 32 by default), one run times ``ops.linear`` on the
same shape held as float32, bfloat16 and each GGML block type, interleaved (A B C ...)
and each figure the median of several calls. Every call reads a different copy of the
weight, from a pool larger than the caches, so a product streams its weight from memory
as a decode step does. Reported: ms per product and the weight bytes it streamed per
second (GB/s), and a headline per type: the time of one layer's seven products at one
row against float32 and bfloat16 (what a decode step's speed follows).

A type whose block does not divide a shape's input (Q4_K and Q6_K need multiples of
256; the 0.5B's 896 is not) is left out of that shape, as llama.cpp's quantizer does.

``python -m bench.experiments.quant_matmul`` writes ``bench/results/quant_matmul.{md,json}``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.common import (
    LoadProbe,
    environment,
    environment_md,
    interleave,
    reproduce_command,
    write_results,
)
from specserve.engine import cpu_kernels, ops
from specserve.engine.quant import FORMATS, GGMLType, QuantizedWeight
from specserve.engine.quant.synthetic import random_weight

# (model, projection, out_features, in_features); a layer has q, k, v, o, gate, up, down.
SHAPES: dict[str, list[tuple[str, int, int]]] = {
    "1.5b": [
        ("q/o", 1536, 1536),
        ("k/v", 256, 1536),
        ("gate/up", 8960, 1536),
        ("down", 1536, 8960),
    ],
    "0.5b": [("q/o", 896, 896), ("k/v", 128, 896), ("gate/up", 4864, 896), ("down", 896, 4864)],
    "tiny": [("q/o", 64, 256), ("down", 40, 512)],  # the smoke test's
}
# How often each projection shape occurs in one layer.
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}
TYPES = ("Q4_K", "Q6_K", "Q5_0", "Q8_0")

Weight = torch.Tensor | QuantizedWeight


def _nbytes(w: Weight) -> int:
    return w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()


def _pool(make: Callable[[int], Weight], pool_bytes: int) -> list[Weight]:
    """Copies of one weight (different seeds) filling ``pool_bytes``, at least one."""
    first = make(0)
    return [first] + [make(i) for i in range(1, math.ceil(pool_bytes / _nbytes(first)))]


def _variants(out: int, k: int, types: list[str], pool_bytes: int) -> dict[str, list[Weight]]:
    gen = torch.Generator().manual_seed(out * 7 + k)
    dense = torch.randn(out, k, generator=gen) * 0.02
    pools: dict[str, list[Weight]] = {
        "float32": _pool(lambda i: dense.roll(i, 0).contiguous(), pool_bytes),
        "bfloat16": _pool(lambda i: dense.roll(i, 0).bfloat16(), pool_bytes),
    }
    for name in types:
        t = GGMLType[name]
        if k % FORMATS[t].block_size == 0:
            pools[name] = _pool(lambda i, t=t: random_weight(t, out, k, seed=i), pool_bytes)
    return pools


def cycling_product(x: torch.Tensor, pool: Sequence[Weight]) -> Callable[[], object]:
    """A product of ``x`` with the next weight of ``pool`` at each call, so a pool larger
    than the caches makes every call stream its weight from memory."""
    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(pool)
        return ops.linear(x, pool[state["i"]])

    return call


def run(
    models: list[str], rows: list[int], types: list[str], reps: int, pool_mib: int
) -> dict[str, Any]:
    """Every (model, shape, rows) cell: ms per product and GB/s of each variant."""
    cells: list[dict[str, Any]] = []
    for model in models:
        for proj, out, k in SHAPES[model]:
            pools = _variants(out, k, types, pool_mib << 20)
            for r in rows:
                x = torch.randn(r, k)
                samples = interleave(
                    {n: cycling_product(x, p) for n, p in pools.items()}, reps=reps, warmup=2
                )
                for name, s in samples.items():
                    ms = s.median * 1e3
                    gbs = _nbytes(pools[name][0]) / s.median / 1e9
                    cells.append(
                        {"model": model, "proj": proj, "out": out, "in": k, "rows": r,
                         "weights": name, "ms": ms, "gb_s": gbs}
                    )  # fmt: skip
            del pools
    return {"cells": cells, "headline": _headline(cells)}


def _headline(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model and type: one layer's seven products at 1 row, ms and x float32 / bfloat16."""
    out: dict[str, Any] = {}
    for model in sorted({c["model"] for c in cells}):
        ones = [c for c in cells if c["model"] == model and c["rows"] == 1]
        projections = {p for p, _, _ in SHAPES[model]}
        layer: dict[str, float] = {}
        for name in {c["weights"] for c in ones}:
            mine = [c for c in ones if c["weights"] == name]
            if {c["proj"] for c in mine} == projections:  # a type on every shape only
                layer[name] = sum(PER_LAYER[c["proj"]] * c["ms"] for c in mine)
        if "float32" not in layer or "bfloat16" not in layer:
            continue
        out[model] = {
            name: {
                "layer_ms_1_row": round(ms, 3),
                "x_float32": round(layer["float32"] / ms, 2),
                "x_bfloat16": round(layer["bfloat16"] / ms, 2),
            }
            for name, ms in sorted(layer.items())
        }
    return out


def markdown(result: dict[str, Any], env: dict[str, Any], command: str) -> str:
    lines = [
        "# Quantized matrix products (bench.experiments.quant_matmul)",
        "",
        environment_md(env),
        "",
        f"Reproduce: `{command}`",
        "",
        "One layer's seven products at 1 row (ms), and how much faster than float32 / bfloat16:",
        "",
        "| model | weights | layer ms | x float32 | x bfloat16 |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for model, per in result["headline"].items():
        for name, h in per.items():
            lines.append(
                f"| {model} | {name} | {h['layer_ms_1_row']:.3f} | {h['x_float32']:.2f} | "
                f"{h['x_bfloat16']:.2f} |"
            )
    lines += [
        "",
        "Every product (ms per call, GB/s of weight bytes streamed):",
        "",
        "| model | shape (out x in) | rows | weights | ms | GB/s |",
        "| --- | --- | ---: | --- | ---: | ---: |",
    ]
    for c in result["cells"]:
        lines.append(
            f"| {c['model']} | {c['proj']} {c['out']}x{c['in']} | {c['rows']} | {c['weights']} | "
            f"{c['ms']:.3f} | {c['gb_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="1.5b,0.5b", help="comma list of: " + ", ".join(SHAPES))
    p.add_argument("--rows", default="1,4,8,32")
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pool-mib", type=int, default=512, help="weight copies per variant")
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
    args = p.parse_args(argv)
    if cpu_kernels.kernels() is None:
        print("the CPU kernels are not available here: nothing to measure", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    probe = LoadProbe()
    with torch.no_grad():
        result = run(
            args.models.split(","),
            [int(r) for r in args.rows.split(",")],
            args.types.split(","),
            args.reps,
            args.pool_mib,
        )
    env = environment()
    env["other_processes_cpu_share"] = probe.others_share()
    command = reproduce_command("bench.experiments.quant_matmul", argv)
    md = markdown(result, env, command)
    print(md)
    if not args.no_write:
        write_results("quant_matmul", md, {"environment": env, "command": command, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
