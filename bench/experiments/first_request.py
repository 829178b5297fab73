"""A fresh stack's first request against the local loop on the same prompt (issue #21's demo).

The local loop (:class:`specserve.local.LocalRunner`, as ``specserve generate --local
-k auto``: one untimed two-token warm-up, then the prompt, drafter model, adaptive k)
runs first, in a child process that exits before the servers load. Then a fresh
stack (target and draft servers and one orchestrator with its defaults, told
``SPECSERVE_DEVICES`` from ``--devices`` where it knows the flag) serves exactly one
request: the same prompt tokens, greedy, ``--new-tokens``, drafter model, adaptive k,
nothing sent before it. The criterion: the stack's mean acceptance length (1 +
accepted / rounds, as both report it) within 20% of the local loop's.

    .venv/bin/python -m bench.experiments.first_request [--prompt 'def fib(n):'] [--new-tokens 96]

Writes ``bench/results/NAME.{md,json}`` (``--name``, default ``first_request``) with a
``headline`` object, unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from bench.common import (
    environment,
    environment_md,
    in_child,
    model_settings,
    reproduce_command,
    write_results,
)
from bench.concurrency import DRAFT, TARGET
from bench.concurrency_report import weight_form
from bench.experiments.policy_ablation import TINY_DRAFT, TINY_TARGET, orchestrator_has_flag
from bench.serving_stack import OrchestratorSetting, declared_devices, serving_stack
from specserve.client import Client
from specserve.engine.model_spec import ModelSpec

WITHIN = 0.20  # the bound on |stack / local - 1| of the mean acceptance length


def encode(target: str, text: str) -> list[int]:
    """The prompt's token ids as ``specserve generate`` encodes it (no chat template);
    a tiny model's ids are the text's UTF-8 bytes."""
    if ModelSpec.parse(target).is_tiny:
        return list(text.encode())
    from specserve import model_store
    from specserve.engine.loader import load_tokenizer

    return list(load_tokenizer(model_store.locate(target)).encode(text))


def local_run(settings: dict[str, Any], prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """The local loop on the prompt, as ``generate --local -k auto`` (child process)."""
    from specserve.engine.sampling import SamplingParams
    from specserve.local import LocalConfig, LocalRunner

    runner = LocalRunner(LocalConfig(**settings))
    runner.generate(prompt[-8:], SamplingParams(), max_new_tokens=2, drafter="none")
    c = runner.generate(prompt, SamplingParams(), max_new_tokens=new_tokens, drafter="model")
    return outcome(c.tokens, c.seconds, c.stats.rounds, c.stats.drafted, c.stats.accepted)


def outcome(
    tokens: list[int], seconds: float, rounds: int, drafted: int, accepted: int
) -> dict[str, Any]:
    """One run's figures; the mean acceptance length is 1 + accepted / rounds."""
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": len(tokens) / seconds if seconds > 0 else 0.0,
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1.0 + accepted / rounds if rounds else 0.0,
    }


def stack_run(args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    """A fresh stack; its first and only request."""
    env = {"SPECSERVE_DEVICES": args.devices}
    with (
        serving_stack(args, {"default": OrchestratorSetting(env=env)}) as st,
        Client(st.orchestrators["default"].address, timeout_s=3600) as client,
    ):
        t0 = time.perf_counter()
        c = client.generate(prompt, max_new_tokens=args.new_tokens, drafter="model")
        seconds = time.perf_counter() - t0
    u = c.usage
    return outcome(c.token_ids, seconds, u.rounds, u.drafted_tokens, u.accepted_tokens)


def headline(local: dict[str, Any], stack: dict[str, Any]) -> dict[str, Any]:
    brief = ("tokens_per_s", "rounds", "drafted", "accepted", "mean_acceptance_length")
    ratio = (
        stack["mean_acceptance_length"] / local["mean_acceptance_length"]
        if local["mean_acceptance_length"]
        else None
    )
    return {
        "local": {k: local[k] for k in brief},
        "stack_first_request": {k: stack[k] for k in brief},
        "mean_acceptance_length_stack_over_local": ratio,
        "within_20_percent": ratio is not None and abs(ratio - 1) <= WITHIN,
        "same_tokens": local["tokens"] == stack["tokens"],
    }


def markdown(h: dict[str, Any], args: argparse.Namespace, env: dict[str, Any]) -> str:
    rows = [("local loop (`generate --local -k auto`)", h["local"])]
    rows.append(("fresh stack, first request", h["stack_first_request"]))
    ratio = h["mean_acceptance_length_stack_over_local"]
    met = "**met**" if h["within_20_percent"] else "**not met**"
    lines = [
        "# A fresh stack's first request vs the local loop",
        "",
        f"Target {args.target} ({args.target_dtype} compute{weight_form(args.target)}), "
        f"draft {args.draft} ({args.draft_dtype} compute{weight_form(args.draft)}), "
        f"{args.threads} torch threads; prompt {args.prompt!r}, greedy, {args.new_tokens} new "
        "tokens, drafter model, adaptive k. The local loop ran first in a child process; the "
        f"stack (devices declared: {env['devices']}) was started "
        "afterwards and served this one request.",
        "",
        "| run | tok/s | rounds | drafted | accepted | mean acc. length |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {r['tokens_per_s']:.2f} | {r['rounds']} | {r['drafted']} | "
            f"{r['accepted']} | {r['mean_acceptance_length']:.2f} |"
        )
    lines += [
        "",
        f"- Stack / local mean acceptance length: "
        f"{'–' if ratio is None else f'{ratio:.2f}'}; within {WITHIN:.0%}: {met}.",
        f"- Same tokens: {'yes' if h['same_tokens'] else 'no'}.",
        "",
        "Reproduce:",
        "",
        "```",
        env["command"],
        "```",
        "",
        environment_md(env),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--target-dtype", default="float32")
    p.add_argument("--draft-dtype", default="bfloat16", help="as `specserve up` (default)")
    p.add_argument("--tiny", action="store_true", help="tiny random models, float32 (smoke test)")
    p.add_argument("--prompt", default="def fib(n):")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2, help="torch threads, local and servers")
    p.add_argument(
        "--devices",
        choices=["shared", "separate"],
        default=None,
        help="what the orchestrator is told (SPECSERVE_DEVICES); default: that variable, "
        "else shared",
    )
    p.add_argument("--target-timeout-s", type=float, default=600.0, help="Verify deadline")
    p.add_argument("--name", default="first_request", help="results file stem")
    p.add_argument("--no-write", action="store_true", help="print the table, write no file")
    args = p.parse_args(argv)
    if args.tiny:
        args.target, args.draft = TINY_TARGET, TINY_DRAFT
        args.target_dtype = args.draft_dtype = "float32"
    args.emulate_devices, args.logs = None, None  # what serving_stack reads
    args.devices = args.devices or declared_devices(args)
    prompt = encode(args.target, args.prompt)
    local = in_child(local_run, model_settings(args), prompt, args.new_tokens)
    stack = stack_run(args, prompt)
    env = environment()
    env["command"] = reproduce_command("bench.experiments.first_request", argv)
    env["devices"] = args.devices if orchestrator_has_flag("--devices") else "not declared"
    h = headline(local, stack)
    md = markdown(h, args, env)
    print(md)
    if not args.no_write:
        data = {"headline": h, "local": local, "stack": stack, "args": vars(args)}
        write_results(args.name, md, {**data, "environment": env})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
