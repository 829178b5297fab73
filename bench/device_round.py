"""The engine's round on a device: wall time per round, kernel launches, device busy time.

The in-process :class:`SpeculativeEngine` (no RPC, no orchestrator) with the tiny pair
(target ``tiny:3:vocab=V``, draft a noisy copy of it), k = 4, 24 new tokens per session,
greedy and sampled (temperature 0.8, top-k 40, top-p 0.95: the coupled draws and the
sparse q a draft sends), at 1, 8 and 32 sessions. Tiny models make the device's own
arithmetic negligible on a GPU, so what a round costs there is the host's work per
round: Python, launching kernels, waiting on copies (on a CPU the vocabulary-wide
output layer and sampling are real compute). That is the floor every round pays
before a real model's compute, and what the stack's own overhead is compared against.

* **ms / round**: median over ``--reps`` decodes (each after the same warm-up), the
  device synchronised before and after.
* On CUDA, three decode rounds of one more decode under ``torch.profiler``:
  **launches / round** (kernel launches the host issued, a CUDA graph's replay one)
  and **device busy** (the kernels' summed device time over those rounds' wall time;
  the rest of a round the GPU waits on the host).

* ``--steps``: how the target runs its decode/verify steps: ``graphs`` (static-shape
  steps replayed as CUDA graphs captured when the engine is built, the default on
  CUDA), ``static`` (the same steps launched from the host), ``eager`` (the eager
  forward and acceptance, the default on a CPU). The draft's steps run the same way.

    .venv/bin/python -m bench.device_round [--device cuda] [--vocab 150000]
        [--steps graphs|static|eager] [--no-write]

Writes ``bench/results/device_round_<cpu|cuda>.{md,json}`` for the device's default
steps, ``device_round_<cpu|cuda>_<steps>`` for another.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

import torch

from bench.common import environment, environment_md, reproduce_command, write_results
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.devices import parse_device
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.static_step import SESSION_BUCKETS
from specserve.engine.step_runner import StepOptions
from specserve.engine.tiny import tiny_from_spec
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy

K = 4
NEW_TOKENS = 24
KV_BUDGET = 64 << 20
MODES = ("greedy", "sampled")
STEPS = ("graphs", "static", "eager")
PROFILED_ROUNDS = 3


def default_steps(device: torch.device) -> str:
    return "graphs" if device.type == "cuda" else "eager"


def step_options(steps: str, widths: list[int]) -> StepOptions | None:
    """The target's step options for ``steps`` (:data:`STEPS`), buckets for ``widths``."""
    if steps == "eager":
        return None
    buckets = tuple(sorted({min(b for b in SESSION_BUCKETS if b >= w) for w in widths}))
    return StepOptions(k_max=K, sessions=buckets, capture=steps == "graphs")


def make_engine(
    device: torch.device, vocab: int, steps: str | None = None, widths: list[int] | None = None
) -> SpeculativeEngine:
    target = tiny_from_spec(f"tiny:3:vocab={vocab}").to(device)
    draft = tiny_from_spec(f"tiny:3:noise=0.3:vocab={vocab}").to(device)
    options = step_options(steps or default_steps(device), widths or [1])
    return SpeculativeEngine(
        TargetVerifier(target, KV_BUDGET, steps=options),
        {"model": ModelDrafter(draft, KV_BUDGET, steps=options)},
    )


def sessions(count: int, mode: str, seed: int) -> list[DecodeState]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(256) for _ in range(12)]
        params = (
            SamplingParams(0.8, top_k=40, top_p=0.95, seed=seed + i)
            if mode == "sampled"
            else SamplingParams()
        )
        out.append(
            DecodeState(
                f"s{seed}-{i}",
                prompt,
                params,
                StopCriteria(NEW_TOKENS),
                KPolicy(K),
                drafter="model",
            )
        )
    return out


def decode(
    engine: SpeculativeEngine, states: list[DecodeState], device: torch.device
) -> tuple[float, int]:
    """(seconds, rounds) to decode ``states`` to the end, device synchronised."""
    sync(device)
    t0 = time.perf_counter()
    rounds = 0
    while active := [s for s in states if not s.finished]:
        engine.round(active)
        rounds += 1
    sync(device)
    for s in states:
        engine.release(s)
    return time.perf_counter() - t0, rounds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiled(
    engine: SpeculativeEngine, states: list[DecodeState], device: torch.device
) -> dict[str, float]:
    """Kernel launches and device busy time per round over :data:`PROFILED_ROUNDS`
    decode rounds after the prefill (CUDA only; the profiler's own cost grows with the
    events it records, so it sees a few rounds, not a whole decode)."""
    from torch.profiler import ProfilerActivity, profile

    engine.round(states)  # the prefill round: not what a decode round costs
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        rounds = 0
        while rounds < PROFILED_ROUNDS and (active := [s for s in states if not s.finished]):
            engine.round(active)
            rounds += 1
        sync(device)
        seconds = time.perf_counter() - t0
    decode(engine, states, device)  # to the end, and release
    events = prof.key_averages()
    # A CUDA graph's replay is one launch (cudaGraphLaunch), however many kernels it holds.
    prefixes = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch")
    launches = sum(e.count for e in events if e.key.startswith(prefixes))
    busy_us = sum(
        getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        for e in events
    )
    return {
        "launches_per_round": launches / max(rounds, 1),
        "device_busy_fraction": busy_us / 1e6 / seconds,
    }


def measure(
    device: torch.device, vocab: int, widths: list[int], reps: int, steps: str | None = None
) -> list[dict]:
    engine = make_engine(device, vocab, steps, widths)
    runner = engine.verifier.steps
    if runner is not None and runner.capture_seconds is not None:
        print(f"captured CUDA graphs in {runner.capture_seconds:.1f} s", file=sys.stderr)
    rows = []
    for width in widths:
        for mode in MODES:
            decode(engine, sessions(width, mode, 1), device)  # warm-up: shapes, allocator
            runs = [decode(engine, sessions(width, mode, 2 + r), device) for r in range(reps)]
            row: dict[str, Any] = {
                "sessions": width,
                "mode": mode,
                "ms_per_round": statistics.median(s / n * 1e3 for s, n in runs),
                "rounds": statistics.median(n for _, n in runs),
                "steps": steps or default_steps(device),
                "static_steps": runner.runs if runner is not None else 0,
            }
            if device.type == "cuda":
                row.update(profiled(engine, sessions(width, mode, 99), device))
            print(f"measured {row}", file=sys.stderr, flush=True)  # progress, if cut short
            rows.append(row)
    return rows


def headline(rows: list[dict], device: torch.device) -> dict[str, Any]:
    keys = ["ms_per_round", "launches_per_round", "device_busy_fraction"]
    out: dict[str, Any] = {"device": device_name(device)}
    for key in keys:
        if any(key in r for r in rows):
            out[key] = {
                mode: {str(r["sessions"]): round(r[key], 3) for r in rows if r["mode"] == mode}
                for mode in MODES
            }
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def report(rows: list[dict], args: argparse.Namespace, env: dict[str, Any]) -> str:
    device = parse_device(args.device)
    cuda = device.type == "cuda"
    lines = [
        f"# The engine's round on {device_name(device)}",
        "",
        f"In-process engine, tiny pair with a {args.vocab:,}-token vocabulary, k = {K}, "
        f"{NEW_TOKENS} new tokens per session; median of {args.reps} decodes; target steps: "
        f"{getattr(args, 'steps', None) or default_steps(device)}. "
        + (
            "On CUDA the tiny models' arithmetic takes microseconds: a round's time is the "
            "host's (Python, kernel launches, copies)."
            if cuda
            else "On a CPU the output layer and the sampling over the whole vocabulary are "
            "real compute: a round's time is the host's cost plus theirs."
        ),
        "",
        "| sessions | mode | ms / round | rounds |"
        + (" launches / round | device busy |" if cuda else ""),
        "|---:|---|---:|---:|" + ("---:|---:|" if cuda else ""),
    ]
    for r in rows:
        line = f"| {r['sessions']} | {r['mode']} | {r['ms_per_round']:.2f} | {r['rounds']:.0f} |"
        if cuda:
            line += f" {r['launches_per_round']:.0f} | {r['device_busy_fraction']:.0%} |"
        lines.append(line)
    lines += [
        "",
        environment_md(env),
        "",
        f"Reproduce: `{reproduce_command('bench.device_round')}`",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=150_000)
    p.add_argument("--sessions", default="1,8,32", help="comma-separated session counts")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", choices=STEPS, help="graphs on CUDA, eager on a CPU by default")
    p.add_argument("--no-write", action="store_true", help="print, do not write results")
    args = p.parse_args()
    device = parse_device(args.device)
    widths = [int(w) for w in args.sessions.split(",")]
    rows = measure(device, args.vocab, widths, args.reps, args.steps)
    env = environment()
    markdown = report(rows, args, env)
    print(markdown)
    if not args.no_write:
        data = {"headline": headline(rows, device), "rows": rows, "environment": env}
        name = f"device_round_{device.type}"
        if args.steps not in (None, default_steps(device)):
            name += f"_{args.steps}"
        write_results(name, markdown, data)


if __name__ == "__main__":
    main()
