"""Ablation of the adaptive-k policy through the whole stack, every variant in one run.

One target server and one draft server (as :mod:`bench.concurrency`: the target
float32, the draft bfloat16, greedy, HumanEval prompts) serve one orchestrator per
variant, each started with its variant's environment and reused over every
repetition. At each concurrency (1, 2, 4, 8 streaming sessions) the variants run
back to back (A B C ..., and again in the next repetition), on the same prompts:

* ``plain``: drafter none, k = 0: plain batched decoding, the baseline;
* ``k=N`` for each of ``--fixed-ks``: the model drafter at the request's fixed k
  (the report picks the best one per concurrency);
* ``default``: the full default policy;
* any further row of :data:`VARIANTS`: the default with some ``PolicyConfig`` fields set.

:data:`VARIANTS` is the table to edit: a variant's environment (``SPECSERVE_*``, and
``SPECSERVE_POLICY`` fields of ``PolicyConfig``), its drafter and its request k. Every
orchestrator also gets ``SPECSERVE_DEVICES`` from ``--devices`` (by default shared: the
servers share this machine's cores). A variant whose ``PolicyConfig`` field the
orchestrator does not have is refused before anything starts.

Greedy tokens must equal plain decoding's: a stream that differs is counted wrong
and its variant marked wrong in the headline. Writes
``bench/results/NAME.{md,json}`` (``--name``, default ``policy_ablation``) unless
``--no-write``:

    .venv/bin/python -m bench.experiments.policy_ablation [--sessions 1,2,4,8] [--reps 3] \\
        [--new-tokens 64] [--fixed-ks 2,4] [--variants plain,default,...] [--tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import LoadProbe, environment, parse_range, reproduce_command, write_results
from bench.concurrency import DRAFT, TARGET, device_ms, int_list, prompts
from bench.experiments import policy_ablation_report as report
from bench.serving_stack import (
    OrchestratorSetting,
    Run,
    declared_devices,
    measure,
    run_streams,
    serving_stack,
)

TINY_TARGET = "tiny:3"
TINY_DRAFT = "tiny:3:noise=0.3"
POLICY_CONFIG = "specserve.policy.config"  # where PolicyConfig lives


@dataclass(frozen=True)
class Variant:
    """One row of the ablation: how its orchestrator is started and what its requests ask."""

    label: str
    env: Mapping[str, str] = field(default_factory=dict)  # SPECSERVE_* of its orchestrator
    policy: Mapping[str, str] = field(default_factory=dict)  # SPECSERVE_POLICY fields
    drafter: str = "model"
    k: int | None = None  # the request's k; None = the policy's

    def orchestrator_env(self, devices: str | None) -> dict[str, str]:
        env = dict(self.env)
        if devices is not None:
            env["SPECSERVE_DEVICES"] = devices
        if self.policy:
            env["SPECSERVE_POLICY"] = ",".join(f"{k}={v}" for k, v in self.policy.items())
        return env


PLAIN = "plain"
DEFAULT = "default"
# name -> variant; the fixed-k rows are added from --fixed-ks. The default policy has no
# component left to switch off (docs/scheduling.md): a new row sets PolicyConfig fields.
VARIANTS: dict[str, Variant] = {
    PLAIN: Variant("plain (k = 0)", drafter="none", k=0),
    DEFAULT: Variant("full policy (defaults)"),
}


def fixed_k_variants(ks: Sequence[int]) -> dict[str, Variant]:
    return {f"k={k}": Variant(f"fixed k = {k}", k=k) for k in ks}


def policy_fields() -> set[str] | None:
    """The orchestrator's ``PolicyConfig`` field names, or None where it has none."""
    try:
        module = importlib.import_module(POLICY_CONFIG)
    except ImportError:
        return None
    return {f.name for f in dataclasses.fields(module.PolicyConfig)}


def orchestrator_has_flag(flag: str) -> bool:
    """Whether the orchestrator's command line knows ``flag`` (e.g. ``--devices``)."""
    from specserve.orchestrator import flags

    parser = argparse.ArgumentParser()
    flags.add_arguments(parser, env={"SPECSERVE_TARGET_ENDPOINTS": "unused"})
    defaults, _ = parser.parse_known_args([])
    return hasattr(defaults, flag.lstrip("-").replace("-", "_"))


def unsupported(variants: Mapping[str, Variant], known: set[str] | None) -> list[str]:
    """Sentences naming each variant whose PolicyConfig fields the orchestrator lacks."""
    out = []
    for name, v in variants.items():
        missing = sorted(set(v.policy) - (known or set()))
        if missing:
            where = "has no PolicyConfig" if known is None else "has no such PolicyConfig field"
            out.append(f"{name} needs {', '.join(missing)}, and the orchestrator {where}")
    return out


def run_ablation(
    args: argparse.Namespace, prompt_list: list[list[int]], variants: Mapping[str, Variant]
) -> list[Run]:
    """Every variant at every concurrency in every repetition, interleaved; one orchestrator
    per variant, reused over the repetitions."""
    widest = max(args.sessions)
    settings = {
        name: OrchestratorSetting(env=v.orchestrator_env(args.devices))
        for name, v in variants.items()
    }
    runs: list[Run] = []
    with serving_stack(args, settings) as st:
        for name, v in variants.items():  # untimed warm-up at the widest batch
            address = st.orchestrators[name].address
            asyncio.run(run_streams(address, prompt_list[:widest], 8, v.drafter, v.k))
        for rep in range(args.reps):
            for c in args.sessions:
                batch = prompt_list[rep * widest : rep * widest + c]
                for name, v in variants.items():
                    runs.append(
                        measure(st, name, name, rep, batch, args.new_tokens, v.drafter, v.k)
                    )
    return runs


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, dict[str, Variant]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=TARGET, help="target model (store name, dir, tiny:...)")
    p.add_argument("--draft", default=DRAFT, help="draft model (same tokenizer as the target)")
    p.add_argument("--target-dtype", default="float32")
    p.add_argument("--draft-dtype", default="bfloat16", help="as `specserve up` (default)")
    p.add_argument("--tiny", action="store_true", help="tiny random models, float32 (smoke test)")
    p.add_argument("--sessions", type=int_list, default=[1, 2, 4, 8], help="concurrencies")
    p.add_argument("--reps", type=int, default=3, help="repetitions (each with its own prompts)")
    p.add_argument("--new-tokens", type=int, default=64, help="max_new_tokens of every request")
    p.add_argument(
        "--prompts",
        type=parse_range,
        default=None,
        help="HumanEval problems to draw from, e.g. 0-23 (default: 0 to reps x widest - 1); "
        "repetition j sends the j-th block of `widest` of them",
    )
    p.add_argument("--fixed-ks", type=int_list, default=[2, 4], help="fixed-k variants")
    p.add_argument(
        "--variants",
        default=None,
        help="comma list of variant names (default: all; plain always runs: the baseline)",
    )
    p.add_argument(
        "--devices",
        choices=["shared", "separate"],
        default=None,
        help="what every orchestrator is told (SPECSERVE_DEVICES); default: that variable, "
        "else separate with --emulate-devices and shared without",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads per server")
    p.add_argument(
        "--emulate-devices",
        type=device_ms,
        default=None,
        metavar="DRAFT_MS,TARGET_MS",
        help="every forward takes this device time, CPU idle (bench.emulated_device)",
    )
    p.add_argument("--target-timeout-s", type=float, default=600.0, help="Verify deadline")
    p.add_argument("--name", default="policy_ablation", help="results file stem")
    p.add_argument("--no-write", action="store_true", help="print the table, write no file")
    p.add_argument("--logs", type=Path, default=None, help="every process's output, here")
    args = p.parse_args(argv)
    if args.tiny:
        args.target, args.draft = TINY_TARGET, TINY_DRAFT
        args.target_dtype = args.draft_dtype = "float32"
    args.sessions = sorted(set(args.sessions))
    table = {**VARIANTS, **fixed_k_variants(args.fixed_ks)}
    chosen = list(table) if args.variants is None else args.variants.split(",")
    chosen = [PLAIN, *(v for v in chosen if v and v != PLAIN)]
    unknown = [v for v in chosen if v not in table]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(table)}")
    variants = {name: table[name] for name in chosen}
    refused = unsupported(variants, policy_fields())
    if refused:
        p.error("; ".join(refused) + " (leave those out with --variants)")
    args.devices = args.devices or declared_devices(args)
    needed = args.reps * max(args.sessions)
    if args.prompts is None:
        args.prompts = list(range(needed))
    if len(args.prompts) < needed:
        p.error(f"--prompts gives {len(args.prompts)} problems; {needed} are needed")
    return args, variants


def main(argv: Sequence[str] | None = None) -> int:
    args, variants = parse_args(argv)
    every = prompts(args.target, max(args.prompts) + 1)
    prompt_list = [every[i] for i in args.prompts]
    env = environment()
    env.update(
        target=f"{args.target} ({args.target_dtype})",
        draft=f"{args.draft} ({args.draft_dtype})",
        server_threads=args.threads,
        devices=(
            args.devices
            if orchestrator_has_flag("--devices")
            else "not declared (the orchestrator has no --devices)"
        ),
        emulate_devices=args.emulate_devices,
        command=reproduce_command("bench.experiments.policy_ablation", argv),
    )
    probe = LoadProbe(children=True)  # the servers are ours
    started = time.monotonic()
    runs = run_ablation(args, prompt_list, variants)
    env["others_cpu_share"] = probe.others_share()
    env["bench_minutes"] = (time.monotonic() - started) / 60
    summary = report.summarize(runs, variants)
    markdown = report.markdown(summary, args, variants, env)
    print(markdown)
    if not args.no_write:
        write_results(
            args.name,
            markdown,
            {
                "headline": summary["headline"],
                "rows": summary["rows"],
                "variants": {n: dataclasses.asdict(v) for n, v in variants.items()},
                "runs": runs,
                "args": vars(args),
                "environment": env,
            },
        )
    return 1 if summary["headline"]["wrong_variants"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
