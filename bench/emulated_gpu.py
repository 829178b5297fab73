"""Rounds at accelerator speed: the stack against the local loop, speculation against plain.

Tiny models whose every forward takes a fixed device time while the CPU idles
(:mod:`bench.emulated_device`), at each ``--settings`` pair DRAFT_MS/TARGET_MS
(default draft 2 ms / target 12 ms, a 7B target on one H100, and 1 ms / 6 ms).
For each setting:

1. **the local loop** (:class:`specserve.local.LocalRunner`, one session, in a
   child process that exits before the servers load): plain decoding (k = 0) and
   adaptive speculation, interleaved prompt by prompt;
2. **the stack**: a target server, a draft server and one orchestrator declared
   ``--devices separate`` with a prefill budget of ``--max-prefill-tokens`` (4096: an
   emulated forward costs the same at any width), as separate processes on loopback
   (session store: a redis-server on loopback as deployed, or ``--store embedded``;
   :func:`bench.serving_stack.serving_stack`); at each of ``--sessions``
   (default 1, 8, 32) concurrent streaming requests, plain (drafter none) and
   adaptive (the orchestrator's defaults), interleaved: repetition j sends the
   same prompts to both, and a repetition's single session the prompt its local
   runs decoded;
3. **where a round goes**: ``--traced`` single-session requests per variant, traced
   through the three processes (:mod:`bench.emulated_gpu_phases`), split into
   device, transport, servers, orchestrator and store.

Before the settings, :mod:`bench.emulated_fidelity` times the tiny models' own CPU per
forward at each session count: where it passes a setting's device time, the figures
there are the CPU's (the report lists them).

The default draft, ``tiny:3:noise=0.05``, is the target with noise of 0.05 on its
weights: on these prompts at draft 2 ms / target 12 ms it had 82-93% of its drafts
accepted at 8 and 32 sessions and 71-75% for the lone session's prompt (two runs, 64
tokens): about the 85% the issue's targets assume. ``noise=0.1`` gave 72-84% at 8
and 32 sessions, ``noise=0.3`` (the earlier default) 26-57%, where drafting rarely
pays at all.

Greedy, EOS ignored (every stream makes ``--new-tokens``), HumanEval prompts as
UTF-8 bytes. Every stream's tokens are checked against plain decoding's for the
same prompt (stack against stack, local against local and against the stack's
single session); a difference is reported as wrong.

    .venv/bin/python -m bench.emulated_gpu [--settings 2/12,1/6] [--sessions 1,8,32] \\
        [--reps 3] [--new-tokens 64] [--draft-ahead 9]

Writes ``bench/results/emulated_gpu.{md,json,png}``; the JSON's ``headline`` has
``stack_over_local`` (setting -> plain / adaptive, one session) and
``adaptive_over_plain`` (setting -> sessions), with the issue's targets.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench import emulated_gpu_report as report
from bench.common import (
    LoadProbe,
    device_name,
    environment,
    in_child,
    model_settings,
    write_results,
)
from bench.concurrency import LocalRun, prompt_ids, prompts
from bench.emulated_fidelity import cpu_bound, forward_cpu_ms, prefill_cpu_ms
from bench.emulated_gpu_phases import round_phases, traced_environment
from bench.serving_stack import (
    REDIS,
    STORES,
    OrchestratorSetting,
    Run,
    measure,
    run_streams,
    serving_stack,
)
from bench.steady_load import SteadyRun, run_steady, steady_prompts, summarize, tails
from specserve.telemetry.receiver import TraceReceiver

ORCHESTRATOR = "separate"
# The orchestrator's prefill budget: an emulated forward costs the same at any width, as a
# GPU's does for a few prompts of the tiny models, so 32 prompts of 300-600 byte tokens
# are admitted in a few rounds rather than the 30 that the CPU default (512) would take.
MAX_PREFILL_TOKENS = 4096
K_MAX = 8  # the orchestrator's k_max: the widest verify the fidelity check times
# Prompts per repetition: repetition r sends from its own block of this many (at least
# the widest session count), so a run of fewer ``--sessions`` sends the same prompts
# as the default run's at those counts (its lone session the same prompt).
PROMPT_BLOCK = 32


def prompt_block(sessions: Sequence[int]) -> int:
    """The prompts each repetition's block holds."""
    return max(PROMPT_BLOCK, *sessions)


# variant -> (drafter, k): k None = adaptive
VARIANTS = {"plain": ("none", 0), "adaptive": ("model", None)}


@dataclass(frozen=True)
class Setting:
    """Device time per forward, in milliseconds."""

    draft_ms: float
    target_ms: float

    @property
    def label(self) -> str:
        return f"{self.draft_ms:g}/{self.target_ms:g}"

    @classmethod
    def parse(cls, text: str) -> Setting:
        draft, sep, target = text.partition("/")
        if not sep:
            raise ValueError(f"a setting is DRAFT_MS/TARGET_MS, e.g. 2/12; got {text!r}")
        setting = cls(float(draft), float(target))
        if setting.draft_ms < 0 or setting.target_ms < 0:
            raise ValueError(f"device times cannot be negative: {text!r}")
        return setting


# -- the local loop, in a child process ------------------------------------------------------


def local_runs(
    models: dict[str, Any],
    setting: Setting,
    prompt_list: list[list[int]],
    new_tokens: int,
    device: str = "cpu",
) -> list[LocalRun]:
    """Single-session local decoding of each prompt, variants interleaved (child process),
    both models on ``device``."""
    from bench.emulated_device import emulate_local
    from specserve.engine.sampling import SamplingParams
    from specserve.local import LocalConfig, LocalRunner

    runner = LocalRunner(LocalConfig(**models, target_device=device, draft_device=device))
    emulate_local(runner, setting.draft_ms, setting.target_ms)
    for drafter, k in VARIANTS.values():  # untimed warm-up
        warm = prompt_list[0][:32]
        runner.generate(warm, SamplingParams(), max_new_tokens=8, drafter=drafter, k=k)
    out = []
    for rep, prompt in enumerate(prompt_list):
        for name, (drafter, k) in VARIANTS.items():
            c = runner.generate(
                prompt,
                SamplingParams(),
                max_new_tokens=new_tokens,
                drafter=drafter,
                k=k,
                ignore_eos=True,
            )
            s = c.stats
            out.append(LocalRun(name, rep, c.tokens, c.seconds, s.drafted, s.accepted, s.rounds))
            print(f"{setting.label} local rep {rep} {name}: {c.tokens_per_second:.2f} tok/s")
    return out


def run_local_in_child(
    args: argparse.Namespace, setting: Setting, prompt_list: list[list[int]]
) -> list[LocalRun]:
    models = model_settings(args)
    return in_child(local_runs, models, setting, prompt_list, args.new_tokens, args.device)


# -- the stack -------------------------------------------------------------------------------


def orchestrator_setting(args: argparse.Namespace) -> OrchestratorSetting:
    """The orchestrator as a deployment on accelerators runs it."""
    budget = str(args.max_prefill_tokens)
    return OrchestratorSetting(("--devices", "separate", "--max-prefill-tokens", budget))


def add_deployment_flags(p: argparse.ArgumentParser) -> None:
    """The flags :func:`orchestrator_setting` and :func:`stack_namespace` read."""
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=MAX_PREFILL_TOKENS,
        help="the orchestrator's prefill budget per round (its CPU default is 512)",
    )
    p.add_argument(
        "--store",
        choices=STORES,
        default=REDIS,
        help="the orchestrator's session store: a redis-server on loopback (as deployed), "
        "or the embedded one (its Lua runs in the orchestrator's process)",
    )
    p.add_argument(
        "--draft-ahead",
        type=int,
        default=9,
        metavar="N",
        help="the draft server drafts up to N tokens ahead while idle (its --draft-ahead, "
        "as the gpu overlay deploys it; 0: off; the local loop has no idle time to draft in)",
    )


def stack_namespace(args: argparse.Namespace, setting: Setting) -> argparse.Namespace:
    """What :func:`serving_stack` reads, for one setting."""
    return argparse.Namespace(
        target=args.target,
        draft=args.draft,
        target_dtype=args.target_dtype,
        draft_dtype=args.draft_dtype,
        threads=args.threads,
        emulate_devices=(setting.draft_ms, setting.target_ms),
        device=getattr(args, "device", "cpu"),  # benchmarks built on these flags lack it
        target_timeout_s=args.target_timeout_s,
        logs=None,
        store=args.store,
        draft_flags=("--draft-ahead", str(args.draft_ahead)) if args.draft_ahead else (),
    )


def run_stack(
    args: argparse.Namespace, setting: Setting, prompt_list: list[list[int]]
) -> tuple[list[Run], list[SteadyRun], dict[str, Any]]:
    """The timed runs of one setting (closed batches, then at more than one session the
    same under constant concurrency), then its traced single-session requests."""
    runs: list[Run] = []
    steady: list[SteadyRun] = []
    widest, block = max(args.sessions), prompt_block(args.sessions)
    stack_args = stack_namespace(args, setting)
    with (
        TraceReceiver() as receiver,
        traced_environment(receiver),
        serving_stack(stack_args, {ORCHESTRATOR: orchestrator_setting(args)}) as st,
    ):
        address = st.orchestrators[ORCHESTRATOR].address
        for drafter, k in VARIANTS.values():  # untimed warm-up at the widest batch
            asyncio.run(run_streams(address, prompt_list[:widest], 8, drafter, k, True))
        for rep in range(args.reps):
            for c in args.sessions:
                batch = [prompt_list[i % len(prompt_list)] for i in prompt_ids(rep, c, block)]
                for name, (drafter, k) in VARIANTS.items():
                    run = measure(
                        st, ORCHESTRATOR, name, rep, batch, args.new_tokens, drafter, k, True
                    )
                    runs.append(run)
                if c == 1 or not args.steady_waves:
                    continue
                sent = steady_prompts(prompt_list, rep, c, block, args.steady_waves)
                for name, (drafter, k) in VARIANTS.items():
                    window, tokens, streams = asyncio.run(
                        run_steady(address, sent, c, args.new_tokens, drafter, k)
                    )
                    steady.append(SteadyRun(name, c, rep, window, tokens, streams))
                    print(
                        f"rep {rep} c={c} {name}, constant concurrency: "
                        f"{tokens / window:.2f} tok/s ({len(sent)} requests)",
                        flush=True,
                    )
        traced_prompts = [prompt_list[(i * block) % len(prompt_list)] for i in range(args.traced)]
        phases = {
            name: round_phases(address, receiver, traced_prompts, args.new_tokens, drafter)
            for name, (drafter, _) in VARIANTS.items()
        }
    return runs, steady, phases


# -- main ------------------------------------------------------------------------------------


def results_stem(device: str) -> str:
    """``emulated_gpu`` for the models on a CPU, ``emulated_gpu_cuda`` on a GPU."""
    return "emulated_gpu" if device == "cpu" else "emulated_gpu_cuda"


def int_list(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x})


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="2/12,1/6", help="DRAFT_MS/TARGET_MS per forward, ...")
    p.add_argument("--sessions", type=int_list, default=[1, 8, 32], help="concurrent sessions")
    p.add_argument("--reps", type=int, default=3, help="repetitions (each with its own prompts)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per stream (EOS ignored)")
    p.add_argument("--traced", type=int, default=3, help="traced requests per variant")
    p.add_argument(
        "--steady-waves",
        type=int,
        default=3,
        help="requests per slot under constant concurrency at each session count above 1 "
        "(0: closed batches only)",
    )
    p.add_argument("--target", default="tiny:3")
    p.add_argument("--draft", default="tiny:3:noise=0.05", help="draft model spec")
    p.add_argument("--target-dtype", default="float32")
    p.add_argument("--draft-dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads per server and local")
    p.add_argument("--target-timeout-s", type=float, default=600.0)
    p.add_argument(
        "--device",
        type=device_name,
        default="cpu",
        help="where the models compute (cpu, cuda, cuda:N): on a GPU the device time is "
        "the emulated one where the forward's own launch is shorter; results then go to "
        "emulated_gpu_cuda.*",
    )
    add_deployment_flags(p)
    p.add_argument("--no-write", action="store_true", help="print, do not write results")
    args = p.parse_args(argv)
    try:
        args.settings = [Setting.parse(s) for s in args.settings.split(",") if s]
    except ValueError as e:
        p.error(str(e))
    if 1 not in args.sessions:
        p.error("--sessions must include 1: the stack is compared with the local loop there")
    if args.reps < 1 or args.new_tokens < 2 or args.traced < 0 or args.steady_waves < 0:
        p.error("--reps >= 1, --new-tokens >= 2, --traced >= 0 and --steady-waves >= 0, please")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns what the JSON holds (written unless ``--no-write``)."""
    args = parse_args(argv)
    widest, block = max(args.sessions), prompt_block(args.sessions)
    prompt_list = prompts(args.target, args.reps * block)  # fewer where HumanEval has fewer
    env = environment()
    probe = LoadProbe(children=True)  # the servers and the local child are ours
    started = time.monotonic()
    models, on = model_settings(args), args.device  # the real forwards, on the models' device
    cpu_ms = in_child(forward_cpu_ms, models, prompt_list[:widest], args.sessions, K_MAX, on)
    prefill_ms = in_child(prefill_cpu_ms, models, prompt_list[:widest], on)
    per_setting = {}
    for setting in args.settings:
        singles = [prompt_list[(i * block) % len(prompt_list)] for i in range(args.reps)]
        local = run_local_in_child(args, setting, singles)
        runs, steady, phases = run_stack(args, setting, prompt_list)
        per_setting[setting.label] = report.summarize_setting(runs, local, phases)
        per_setting[setting.label]["steady"] = summarize(steady)
        per_setting[setting.label]["closed_tail"] = tails(runs)
    env["other_processes_cpu_share"] = probe.others_share()
    env["bench_minutes"] = (time.monotonic() - started) / 60
    argv_list = list(argv) if argv is not None else sys.argv[1:]
    data = {
        "headline": report.headline(per_setting),
        "settings": per_setting,
        "fidelity": {
            "device": on,
            "cpu_ms": cpu_ms,
            "prefill_cpu_ms": prefill_ms,
            "cpu_bound": {
                s.label: cpu_bound(cpu_ms, s.draft_ms, s.target_ms, prefill_ms, on)
                for s in args.settings
            },
        },
        "args": {**vars(args), "settings": [s.label for s in args.settings]},
        "environment": env,
    }
    stem = results_stem(args.device)
    markdown = report.markdown(data, argv_list, stem)
    print(markdown)
    if not args.no_write:
        md_path, _ = write_results(stem, markdown, data)
        report.plot(data, md_path.with_suffix(".png"))
    return data


if __name__ == "__main__":
    main()
