"""Real shapes on a device: a target step against its HBM floor, verify cost by rows,
a draft step, through the engine's static-shape steps (CUDA graphs where CUDA runs).

A target of Qwen2.5-7B's shape and a draft of Qwen2.5-0.5B's shape, with random weights
made on the device through the loader's path (:func:`~specserve.engine.loader.random_model`;
no checkpoint is read, the tokens mean nothing, the arithmetic and the bytes are a real
model's). Each model's decode/verify step runs as a
:class:`~specserve.engine.step_runner.StepRunner` runs it in a server: one session (or
``--sessions`` of them) with ``--cached`` positions in its KV cache, greedy, each bucket of
1..``max(--rows)`` new tokens captured as a CUDA graph (``--no-capture``: launched from
the host). Measured:

* **copy bandwidth**: a ``--stream-mib`` buffer copied on the device, (read + write
  bytes) / time, best of ``--reps``;
* **HBM floor** of a step: the model's weight bytes / that bandwidth (a step reads
  every weight once);
* **ms / step** for 1..max(rows) rows per session: median of ``--reps`` timed steps
  (the host's input copy, the replay and the read-back of the accepted counts), with
  and without the graph; **x floor** and **x one row** beside them.

    .venv/bin/python -m bench.device_shapes [--device cuda] [--target qwen2.5-7b]
        [--draft qwen2.5-0.5b] [--rows 1-9] [--sessions 1,8] [--no-write]

Writes ``bench/results/device_shapes_<cpu|cuda>.{md,json}``; ``--target tiny --draft
tiny --dtype float32`` is the CPU smoke test's shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from bench.common import environment, environment_md, range_list, reproduce_command, write_results
from specserve.engine.config import ModelConfig
from specserve.engine.devices import parse_device
from specserve.engine.dtypes import parse_dtype
from specserve.engine.loader import random_model
from specserve.engine.static_step import N_DRAFT, N_NEW, START, Bucket
from specserve.engine.step_runner import StepOptions, StepRunner
from specserve.engine.tiny import tiny_config

SHAPES: dict[str, ModelConfig] = {
    "qwen2.5-7b": ModelConfig(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1e6,
        attention_bias=True,
    ),
    "qwen2.5-0.5b": ModelConfig(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1e6,
        attention_bias=True,
        tie_word_embeddings=True,
    ),
    "tiny": tiny_config(),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, mib: int, reps: int) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of ``reps``."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(max(reps, 3)):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def weight_bytes(model: torch.nn.Module) -> int:
    seen = {id(p): p for p in model.parameters()}  # a tied head once
    return sum(p.numel() * p.element_size() for p in seen.values())


def measure_model(
    name: str, args: argparse.Namespace, device: torch.device, bandwidth: float, rows: list[int]
) -> list[dict[str, Any]]:
    """Step times of the ``name`` shape at each (sessions, rows), with and without graphs."""
    cfg = SHAPES[name]
    t0 = time.perf_counter()
    model = random_model(cfg, parse_dtype(args.dtype), device, seed=1)
    sync(device)
    built_s = time.perf_counter() - t0
    kv = model.new_kv_pool(args.kv_mib << 20)
    options = StepOptions(
        k_max=max(rows) - 1,
        context=args.context,
        sessions=tuple(args.sessions),
        capture=not args.no_capture,
        sampled=False,
    )
    runner = StepRunner(model, kv, options, vocab_limit=cfg.vocab_size)
    floor_s = weight_bytes(model) / bandwidth
    print(
        f"{name}: {weight_bytes(model) / 1e9:.2f} GB of weights built in {built_s:.1f} s, "
        f"floor {floor_s * 1e3:.3f} ms, capture {runner.capture_seconds} s",
        file=sys.stderr,
        flush=True,
    )
    out = []
    gen = torch.Generator().manual_seed(0)
    for sessions in args.sessions:
        ids = [f"{name}-{i}" for i in range(sessions)]
        kv.reserve({sid: args.cached + max(rows) for sid in ids})
        for sid in ids:
            kv.advance(sid, args.cached)
        one_row: float | None = None
        for t in rows:
            bucket = Bucket(sessions, t, False)
            lay = runner.step.layout(bucket)
            ints, floats = runner.step.inputs(bucket, torch.device("cpu"))
            for b, sid in enumerate(ids):
                ints[b, START], ints[b, N_NEW], ints[b, N_DRAFT] = args.cached, t, t - 1
                ints[b, lay.token_ids] = torch.randint(cfg.vocab_size, (t,), generator=gen)
                ints[b, lay.drafts][: t - 1] = ints[b, lay.token_ids][1:]
                reserved = min(len(kv.alloc.block_table(sid)) * kv.block_size, runner.context)
                ints[b, lay.table][:reserved] = kv.host_slots(sid, 0, reserved)
            graph, eager = time_bucket(runner, bucket, ints, floats, device, args.reps)
            one_row = one_row or graph
            row = {
                "model": name,
                "sessions": sessions,
                "rows": t,
                "ms_graph" if runner.graphs else "ms_static": graph,
                "ms_no_graph": eager,
                "floor_ms": floor_s * 1e3,
                "x_floor": graph / (floor_s * 1e3),
                "x_one_row": graph / one_row,
                "weight_gb": weight_bytes(model) / 1e9,
                "capture_s": runner.capture_seconds,
            }
            print(f"measured {row}", file=sys.stderr, flush=True)
            out.append(row)
        for sid in ids:
            kv.release(sid)
    del runner, model, kv
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def time_bucket(
    runner: StepRunner,
    bucket: Bucket,
    ints: torch.Tensor,
    floats: torch.Tensor,
    device: torch.device,
    reps: int,
) -> tuple[float, float]:
    """ms per step as a server runs it (host inputs, graph replay where captured, read
    back), and of the static step launched from the host on inputs already there."""
    graph = median_ms(lambda: runner.run(bucket, ints, floats).tolist(), reps)
    dev_ints, dev_floats = ints.to(device), floats.to(device)
    eager = median_ms(lambda: runner.step(bucket, dev_ints, dev_floats).tolist(), max(reps // 2, 1))
    return graph, eager


def median_ms(fn: Any, reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # ends in a read back: the device is done
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def report(rows: list[dict], args: argparse.Namespace, bandwidth: float, env: dict) -> str:
    graphs = "ms_graph" in rows[0] if rows else False
    key = "ms_graph" if graphs else "ms_static"
    lines = [
        f"# Real shapes on {args.device}: step time against the HBM floor",
        "",
        f"Random {args.dtype} weights of each shape, made on the device; one step of "
        f"greedy decode/verify per call with {args.cached} cached positions per session, "
        f"slot tables {args.context} wide; median of {args.reps} steps. Copy bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s (read + write); floor = weight bytes / bandwidth. "
        + ("Steps replay CUDA graphs." if graphs else "Steps are launched from the host."),
        "",
        "| model | sessions | rows | ms / step | no graph | floor ms | x floor | x one row |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['sessions']} | {r['rows']} | {r[key]:.3f} | "
            f"{r['ms_no_graph']:.3f} | {r['floor_ms']:.3f} | {r['x_floor']:.2f} | "
            f"{r['x_one_row']:.2f} |"
        )
    lines += [
        "",
        environment_md(env),
        "",
        f"Reproduce: `{reproduce_command('bench.device_shapes')}`",
    ]
    return "\n".join(lines) + "\n"


def headline(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The issue's figures at one session: the target's step against its HBM floor, its
    verify of 5 (and 9) rows against one row, and the draft's step against its floor."""
    one = [r for r in rows if r["sessions"] == 1]
    target = {r["rows"]: r for r in one if r["model"] == args.target}
    draft = {r["rows"]: r for r in one if r["model"] == args.draft}
    return {
        "target": args.target,
        "target_step_over_floor": target[1]["x_floor"] if 1 in target else None,
        "verify_rows_over_one": {str(t): r["x_one_row"] for t, r in target.items() if t > 1},
        "draft": args.draft,
        "draft_step_over_floor": draft[1]["x_floor"] if 1 in draft else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--target", default="qwen2.5-7b", choices=sorted(SHAPES))
    p.add_argument("--draft", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=range_list, default=list(range(1, 10)), help="e.g. 1-9")
    p.add_argument("--draft-rows", type=range_list, default=[1])
    p.add_argument("--sessions", type=range_list, default=[1, 8])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--cached", type=int, default=512)
    p.add_argument("--kv-mib", type=int, default=4096)
    p.add_argument("--stream-mib", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-capture", action="store_true", help="launch steps from the host")
    p.add_argument("--no-write", action="store_true", help="print, do not write results")
    args = p.parse_args(argv)
    device = parse_device(args.device)
    bandwidth = copy_bandwidth(device, args.stream_mib, args.reps)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s", file=sys.stderr, flush=True)
    rows = measure_model(args.target, args, device, bandwidth, args.rows)
    rows += measure_model(args.draft, args, device, bandwidth, args.draft_rows)
    env = environment()
    markdown = report(rows, args, bandwidth, env)
    print(markdown)
    if not args.no_write:
        data = {
            "headline": headline(rows, args),
            "copy_bandwidth_gbs": bandwidth / 1e9,
            "rows": rows,
            "environment": env,
        }
        write_results(f"device_shapes_{device.type}", markdown, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
