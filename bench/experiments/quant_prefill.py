"""Prefill products of quantized weights: whole-matrix dequantization against tiles.

One decoder layer's seven products (q, k, v, o through ``ops.linears`` / ``ops.linear``,
gate and up through ``ops.gate_up_silu``, down) at prefill row counts, on synthetic
weights of the real shapes (:data:`SHAPES`; no model is loaded), four
ways, interleaved and each the median of several calls:

``float32``
    float32 weights through ``ops`` (tile by tile past 32 rows, since tiling).
``float32_whole``
    float32 weights through one ``F.linear`` per matrix (the float32 path before tiling).
``quantized``
    the model's block type through ``ops``: one tile of weight rows dequantized into a
    reused buffer at a time (:mod:`specserve.engine.tiled_products`).
``quantized_whole``
    the same weights dequantized whole on every call, then ``F.linear`` (the quantized
    path before tiling).

Reported: ms per layer, and projected prefill tokens/s = rows / (layers x layer ms),
which leaves out attention, norms and the LM head (one row per sequence in a prefill).

``python -m bench.experiments.quant_prefill`` writes ``bench/results/quant_prefill.{md,json}``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import (
    LoadProbe,
    environment,
    environment_md,
    interleave,
    reproduce_command,
    write_results,
)
from specserve.engine import cpu_kernels, ops
from specserve.engine.quant import GGMLType, QuantizedWeight
from specserve.engine.quant.synthetic import random_weight


def _shapes(hidden: int, kv: int, inter: int) -> dict[str, tuple[int, int]]:
    """[out, in] of a layer's q, k, v, o, gate, up and down."""
    return {
        "q": (hidden, hidden),
        "k": (kv, hidden),
        "v": (kv, hidden),
        "o": (hidden, hidden),
        "gate": (inter, hidden),
        "up": (inter, hidden),
        "down": (hidden, inter),
    }


# The real configs' shapes and layers (tiny: the smoke test's); the block type a layer's
# matrices use here (Q4_K_M keeps most of the 1.5B's in Q4_K; the 0.5B's 896 columns
# take Q5_0).
SHAPES = {
    "1.5b": _shapes(1536, 256, 8960),
    "0.5b": _shapes(896, 128, 4864),
    "tiny": _shapes(256, 64, 512),
}
LAYERS = {"1.5b": 28, "0.5b": 24, "tiny": 2}
TYPE = {"1.5b": GGMLType.Q4_K, "0.5b": GGMLType.Q5_0, "tiny": GGMLType.Q8_0}

Weight = torch.Tensor | QuantizedWeight
Layer = dict[str, Weight]


def _layer(model: str, quantized: bool) -> Layer:
    """q, k, v, o, gate, up, down of ``model``'s shapes, random (seeded)."""
    layer: Layer = {}
    for seed, (name, (out, k)) in enumerate(SHAPES[model].items()):
        if quantized:
            layer[name] = random_weight(TYPE[model], out, k, seed=seed)
        else:
            gen = torch.Generator().manual_seed(seed)
            layer[name] = torch.randn(out, k, generator=gen) * 0.02
    return layer


def _forward(layer: Layer, x: torch.Tensor, xi: torch.Tensor) -> None:
    """The layer's products as the decoder makes them (x: hidden rows, xi: intermediate)."""
    ops.linears(x, [layer["q"], layer["k"], layer["v"]], [None, None, None])
    ops.linear(x, layer["o"])
    ops.gate_up_silu(x, layer["gate"], layer["up"])
    ops.linear(xi, layer["down"])


def _whole(layer: Layer, x: torch.Tensor, xi: torch.Tensor) -> None:
    """The same with each weight widened whole and one ``F.linear`` each (before tiling)."""

    def wide(name: str) -> torch.Tensor:
        w = layer[name]
        return ops.dequantized(w) if isinstance(w, QuantizedWeight) else w

    for name in ("q", "k", "v", "o"):
        F.linear(x, wide(name))
    F.silu(F.linear(x, wide("gate"))) * F.linear(x, wide("up"))
    F.linear(xi, wide("down"))


def run(models: list[str], rows: list[int], reps: int) -> dict[str, Any]:
    """ms per layer of each variant at each row count, and the projected tokens/s."""
    cells: list[dict[str, Any]] = []
    for model in models:
        dense, blocks = _layer(model, quantized=False), _layer(model, quantized=True)
        hidden, inter = dense["q"].shape[1], dense["gate"].shape[0]
        for r in rows:
            x, xi = torch.randn(r, hidden), torch.randn(r, inter)
            calls: dict[str, Callable[[], object]] = {
                "float32": partial(_forward, dense, x, xi),
                "float32_whole": partial(_whole, dense, x, xi),
                "quantized": partial(_forward, blocks, x, xi),
                "quantized_whole": partial(_whole, blocks, x, xi),
            }
            for name, s in interleave(calls, reps=reps, warmup=1).items():
                ms = s.median * 1e3
                cells.append(
                    {"model": model, "type": TYPE[model].name, "rows": r, "variant": name,
                     "layer_ms": ms, "tokens_s": r / (LAYERS[model] * s.median)}
                )  # fmt: skip
    return {"cells": cells, "headline": _headline(cells)}


def _headline(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model and row count: tiled quantized tokens/s against whole-matrix and float32."""
    out: dict[str, Any] = {}
    for c in cells:
        if c["variant"] != "quantized":
            continue
        same = {
            d["variant"]: d["tokens_s"]
            for d in cells
            if d["model"] == c["model"] and d["rows"] == c["rows"]
        }
        out[f"{c['model']} {c['rows']} rows"] = {
            "tokens_s": round(c["tokens_s"], 1),
            "x_quantized_whole": round(c["tokens_s"] / same["quantized_whole"], 2),
            "x_float32_whole": round(c["tokens_s"] / same["float32_whole"], 2),
        }
    return out


def markdown(result: dict[str, Any], env: dict[str, Any], command: str) -> str:
    lines = [
        "# Prefill products of quantized weights (bench.experiments.quant_prefill)",
        "",
        environment_md(env),
        "",
        f"Reproduce: `{command}`",
        "",
        "Projected prefill tokens/s of the layers' products (attention, norms, LM head left out):",
        "",
        "| model rows | tiled quantized tok/s | x whole-matrix dequantization | x float32 |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key, h in result["headline"].items():
        lines.append(
            f"| {key} | {h['tokens_s']:.1f} | {h['x_quantized_whole']:.2f} | "
            f"{h['x_float32_whole']:.2f} |"
        )
    lines += [
        "",
        "| model | type | rows | variant | ms per layer | tok/s |",
        "| --- | --- | ---: | --- | ---: | ---: |",
    ]
    for c in result["cells"]:
        lines.append(
            f"| {c['model']} | {c['type']} | {c['rows']} | {c['variant']} | "
            f"{c['layer_ms']:.2f} | {c['tokens_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="1.5b,0.5b", help="comma list of: " + ", ".join(SHAPES))
    p.add_argument("--rows", default="64,128,256,512")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
    args = p.parse_args(argv)
    if cpu_kernels.kernels() is None:
        print("the CPU kernels are not available here: nothing to measure", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    probe = LoadProbe()
    with torch.no_grad():
        result = run(args.models.split(","), [int(r) for r in args.rows.split(",")], args.reps)
    env = environment()
    env["other_processes_cpu_share"] = probe.others_share()
    command = reproduce_command("bench.experiments.quant_prefill", argv)
    md = markdown(result, env, command)
    print(md)
    if not args.no_write:
        write_results("quant_prefill", md, {"environment": env, "command": command, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
