"""How far each quantized product of the 1.5B target is from this machine's floors.

Three floors, measured in the same run as the products:

memory
    The weight's bytes over the streaming read bandwidth of ``--threads`` threads
    (:class:`bench.common.StreamMeter`: 1 GiB on huge pages, the best of 5 reads).
FMA
    ``rows * out * in`` multiply-adds over the float32 FMA rate (torch's sgemm on
    ``--gemm-n`` square matrices at ``--threads`` threads, best of 5). The exactness rule
    (one float32 FMA per row and weight, in the float32 kernel's order) makes this the
    least compute any exact kernel can do: the marginal row's floor.
kernel compute ("hot")
    The same kernel on the same ``in`` and type with its weight in cache: one call over a
    weight of ~``--hot-kib`` KiB given ``--hot-repeat`` times per thread (each thread
    re-reads it from L2), fastest of 5, scaled to the shape. That is the widening plus
    the FMAs without memory stalls: what the kernel would cost if memory were free.

A product itself is timed as :mod:`bench.experiments.quant_matmul` times it (a pool of copies of
the weight larger than the caches, here on huge pages as a served model's weights are),
the fastest of ``--reps`` calls (on a shared machine other processes only add time;
the median is reported beside it). Reported per (shape, type, rows): ms, each floor in
ms, and ms over the larger of memory and hot (1.0: the kernel is at its own bound).

The step projection sums the products of one decode step of the synthetic Q4_K_M target
(:func:`bench.experiments.quant_decode_profile.q4_k_m_type`: 28 layers, the tied Q6_K LM head on
every row, as a verify computes logits for every row) at each row count, beside the same
sums of the floors. ``python -m bench.experiments.quant_floors`` prints it (nothing is written).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from bench.common import LoadProbe, StreamMeter, environment, environment_md, interleave
from bench.experiments.quant_decode_profile import TARGET, q4_k_m_type
from bench.experiments.quant_matmul import cycling_product
from specserve.engine import cpu_kernels, ops
from specserve.engine.hugepages import huge_page_buffer
from specserve.engine.quant import GGMLType, QuantizedWeight
from specserve.engine.quant.synthetic import random_weight

# (projection, out, in) of the 1.5B target, and the LM head (tied embedding).
SHAPES = {
    "q/o": (1536, 1536),
    "k/v": (256, 1536),
    "gate/up": (8960, 1536),
    "down": (1536, 8960),
    "lm_head": (TARGET.vocab_size, 1536),
    "tiny": (64, 512),  # the smoke test's
}
_PROJ = {"q_proj": "q/o", "o_proj": "q/o", "k_proj": "k/v", "v_proj": "k/v",
         "gate_proj": "gate/up", "up_proj": "gate/up", "down_proj": "down"}  # fmt: skip


def step_products(layers: int = TARGET.num_layers) -> Counter[tuple[str, str]]:
    """(shape, type name) -> how many products of it one step of the target runs."""
    count: Counter[tuple[str, str]] = Counter()
    for i in range(layers):
        for name, shape in _PROJ.items():
            count[shape, q4_k_m_type(i, layers, name).name] += 1
    count["lm_head", "Q6_K"] += 1
    return count


def fma_rate(threads: int, n: int = 2048, reps: int = 5) -> float:
    """Float32 multiply-adds per second of torch's sgemm on ``n`` x ``n`` (best of ``reps``)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_seconds(lambda: torch.mm(a, b)) for _ in range(reps))
    return n**3 / best


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def huge_page_pool(
    make: Callable[[int], QuantizedWeight], pool_bytes: int
) -> list[QuantizedWeight]:
    """Copies of one quantized weight (``make(seed)``) filling ``pool_bytes`` (at least
    one), their blocks side by side in one huge-page mapping as a served model's are."""
    first: QuantizedWeight = make(0)
    count = max(1, -(-pool_bytes // first.nbytes))
    stride = -(-first.nbytes // 64) * 64
    raw = huge_page_buffer(stride * count)
    pool = []
    for i in range(count):
        w = first if i == 0 else make(i)
        blocks = raw[i * stride : i * stride + w.nbytes].view(w.blocks.shape)
        blocks.copy_(w.blocks)
        pool.append(QuantizedWeight(w.ggml_type, w.shape, blocks))
    return pool


def hot_seconds_per_weight(
    ggml_type: GGMLType, k: int, rows: int, threads: int, hot_kib: int, repeat: int, reps: int
) -> float:
    """Seconds per weight value of the kernel with its weight in cache (module doc)."""
    probe = random_weight(ggml_type, 1, k, seed=0)
    out = max(1, hot_kib * 1024 // probe.nbytes)
    w = random_weight(ggml_type, out, k, seed=1)
    x = torch.randn(rows, k)
    ws = [w] * (repeat * threads)  # each thread's range: its own repeats of the weight
    ops.linears(x, ws, [None] * len(ws))
    best = min(_seconds(lambda: ops.linears(x, ws, [None] * len(ws))) for _ in range(reps))
    return best / (len(ws) * out * k)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Floors, then every (shape, type, rows) cell; then the step projection."""
    threads, rows_list = args.threads, [int(r) for r in args.rows.split(",")]
    meter = StreamMeter(args.stream_mib << 20)
    torch.set_num_threads(threads)
    bandwidth = max(meter.sample(5))  # the least disturbed read
    del meter
    macs = fma_rate(threads, args.gemm_n)
    shapes = args.shapes.split(",")
    wanted = {(s, t) for s, t in step_products()} if args.step else set()
    for s in shapes:
        wanted |= {(s, t) for t in args.types.split(",") if t}
    cells: list[dict[str, Any]] = []
    hot: dict[tuple[str, int, int], float] = {}
    for shape, type_name in sorted(wanted):
        if shape not in shapes:
            continue
        out, k = SHAPES[shape]
        t = GGMLType[type_name]
        pool = huge_page_pool(partial(random_weight, t, out, k), args.pool_mib << 20)
        for rows in rows_list:
            key = (type_name, k, rows)
            if key not in hot:
                hot[key] = hot_seconds_per_weight(
                    t, k, rows, threads, args.hot_kib, args.hot_repeat, 5
                )
            product = cycling_product(torch.randn(rows, k), pool)
            s = interleave({"p": product}, args.reps, warmup=2)["p"]
            floors = {
                "memory_ms": pool[0].nbytes / bandwidth * 1e3,
                "fma_ms": rows * out * k / macs * 1e3,
                "hot_ms": hot[key] * out * k * 1e3,
            }
            ms = min(s.times) * 1e3  # on a shared machine others' load only adds time
            bound = max(floors["memory_ms"], floors["hot_ms"])
            cells.append({"shape": shape, "out": out, "in": k, "type": type_name,
                          "rows": rows, "ms": ms, "median_ms": s.median * 1e3, **floors,
                          "x_bound": ms / bound})  # fmt: skip
        del pool
    return {
        "read_gb_s": bandwidth / 1e9,
        "fma_gmac_s": macs / 1e9,
        "cells": cells,
        "step": _step(cells, rows_list) if args.step else [],
    }


def _step(cells: list[dict[str, Any]], rows_list: list[int]) -> list[dict[str, Any]]:
    """Per row count: the step's products summed (ms and each floor)."""
    by = {(c["shape"], c["type"], c["rows"]): c for c in cells}
    out = []
    for rows in rows_list:
        total = dict.fromkeys(("ms", "memory_ms", "fma_ms", "hot_ms"), 0.0)
        for (shape, type_name), n in step_products().items():
            cell = by[shape, type_name, rows]
            for f in total:
                total[f] += n * cell[f]
        out.append({"rows": rows, **total})
    return out


def markdown(result: dict[str, Any], env: dict[str, Any]) -> str:
    lines = [
        "# Quantized products against this machine's floors (bench.experiments.quant_floors)",
        "",
        environment_md(env),
        "",
        f"Streaming read {result['read_gb_s']:.1f} GB/s; float32 FMA rate "
        f"{result['fma_gmac_s']:.1f} G multiply-adds/s (sgemm).",
        "",
        "| shape | type | rows | ms | memory floor | FMA floor | hot (widen + FMA) | x bound "
        "| median ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in result["cells"]:
        lines.append(
            f"| {c['shape']} {c['out']}x{c['in']} | {c['type']} | {c['rows']} | {c['ms']:.3f} | "
            f"{c['memory_ms']:.3f} | {c['fma_ms']:.3f} | {c['hot_ms']:.3f} | {c['x_bound']:.2f} "
            f"| {c['median_ms']:.3f} |"
        )
    if result["step"]:
        lines += [
            "",
            "One step's products (28 layers + LM head), summed:",
            "",
            "| rows | ms | memory floor | FMA floor | hot (widen + FMA) |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for s in result["step"]:
            lines.append(
                f"| {s['rows']} | {s['ms']:.1f} | {s['memory_ms']:.1f} | {s['fma_ms']:.1f} | "
                f"{s['hot_ms']:.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="q/o,k/v,gate/up,down,lm_head",
                   help="comma list of: " + ", ".join(SHAPES))  # fmt: skip
    p.add_argument("--types", default="Q4_K,Q6_K", help="on every shape ('': none)")
    p.add_argument("--rows", default="1,5,9")
    p.add_argument("--step", action="store_true", help="the shapes and types of a step too")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pool-mib", type=int, default=512, help="weight copies per cell")
    p.add_argument("--stream-mib", type=int, default=1024)
    p.add_argument("--gemm-n", type=int, default=2048)
    p.add_argument("--hot-kib", type=int, default=1024, help="cached weight per thread")
    p.add_argument("--hot-repeat", type=int, default=16)
    args = p.parse_args(argv)
    if cpu_kernels.kernels() is None:
        print("the CPU kernels are not available here: nothing to measure", file=sys.stderr)
        return 1
    probe = LoadProbe()
    with torch.no_grad():
        result = run(args)
    env = environment()
    env["other_processes_cpu_share"] = probe.others_share()
    print(markdown(result, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
