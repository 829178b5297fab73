"""What the draft replica forwarding its proposal straight to the target could save a round.

Issue 22, Build 4: today a drafting round's proposal travels draft -> orchestrator
-> target (the Propose answer, the orchestrator's Python between the calls, the
Verify request). Forwarding would send it draft -> target. This measures the
**hop** that forwarding removes, from traced rounds of the stack at emulated
accelerator speed (:mod:`bench.emulated_device`; the stack of
:func:`bench.serving_stack.serving_stack`, ``--devices separate``), for each
drafting decode round (:func:`round_hops`):

* **hop**: from the end of the draft's forward (its model-thread span) to the
  start of the target's Verify server span. Forwarding cannot save more than
  this: it is the upper bound;
* **kept**: what a forwarded proposal would still cost on that path: the draft
  server's time after its forward (it must still answer) plus one one-way trip,
  taken as half the Verify call's transport (client span minus server span);
* **saved** = hop - kept, the estimate.

At each ``--sessions`` count, ``--reps`` repetitions each send that many traced
adaptive requests at once (greedy, EOS ignored); the spread between the
repetitions' mean round times is what a saving must beat to be worth building.

    .venv/bin/python -m bench.experiments.forwarding_hop [--setting 2/12] [--sessions 1,8] \\
        [--reps 3] [--new-tokens 32] [--no-write]

Writes ``bench/results/forwarding_hop.{md,json}`` unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import secrets
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from bench.common import environment, environment_md, reproduce_command, write_results
from bench.concurrency import prompts
from bench.emulated_gpu import (
    Setting,
    add_deployment_flags,
    int_list,
    orchestrator_setting,
    stack_namespace,
)
from bench.emulated_gpu_phases import request_spans, traced_environment
from bench.round_phases_spans import Tree
from bench.serving_stack import serving_stack
from specserve.client import Client
from specserve.telemetry.attributes import SPAN_PROPOSE, SPAN_ROUND, SPAN_VERIFY
from specserve.telemetry.receiver import ReceivedSpan, TraceReceiver

PROPOSE = "/specserve.v1.DraftService/Propose"
VERIFY = "/specserve.v1.TargetService/Verify"
DRAFT_FORWARD = "specserve.draft.propose"


def round_hops(spans: list[ReceivedSpan]) -> list[dict[str, float]]:
    """Per drafting round in ``spans`` (one or more traces): seconds of ``round``,
    ``hop``, ``kept`` and ``saved`` (module docstring). A round counts once: the batch's
    phases hang under one session's round span, the other sessions' have none."""
    tree = Tree(spans)
    out = []
    for rnd in spans:
        if rnd.name != SPAN_ROUND:
            continue
        forwards_end = [
            (f.end_ns, srv.end_ns)
            for phase in tree.children(rnd, SPAN_PROPOSE)
            for client in tree.children(phase, PROPOSE)
            for srv in tree.children(client, PROPOSE)
            for f in tree.children(srv, DRAFT_FORWARD)
        ]
        verifies = [
            (client, srv)
            for phase in tree.children(rnd, SPAN_VERIFY)
            for client in tree.children(phase, VERIFY)
            for srv in tree.children(client, VERIFY)
        ]
        if not forwards_end or not verifies:
            continue  # a plain round, or not the batch's leader
        forward_end, server_end = max(forwards_end)
        client, srv = verifies[0]  # the first Verify (a resend or replay comes later)
        hop = (srv.start_ns - forward_end) / 1e9
        one_way = (client.duration_s - srv.duration_s) / 2
        kept = (server_end - forward_end) / 1e9 + one_way
        out.append({"round": rnd.duration_s, "hop": hop, "kept": kept, "saved": hop - kept})
    return out


def _traced_request(address: str, prompt: list[int], new_tokens: int) -> str:
    """One sampled, traced adaptive request; its trace id."""
    trace_id = secrets.token_hex(16)
    with Client(address, timeout_s=600) as client:
        client.metadata = (("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),)
        client.generate(prompt, max_new_tokens=new_tokens, drafter="model", ignore_eos=True)
    return trace_id


def traced_batch(
    address: str, receiver: TraceReceiver, batch: Sequence[list[int]], new_tokens: int
) -> list[dict[str, float]]:
    """Every prompt of ``batch`` at once, each traced; the hops of their drafting rounds."""
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        ids = list(pool.map(lambda p: _traced_request(address, p, new_tokens), batch))
    spans = [s for trace_id in ids for s in request_spans(receiver, trace_id)]
    return round_hops(spans)


def summarize(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Mean milliseconds of each quantity over the rounds (and how many)."""
    if not rounds:
        return {"rounds": 0}
    keys = ("round", "hop", "kept", "saved")
    means = {f"{k}_ms": 1e3 * statistics.fmean(r[k] for r in rounds) for k in keys}
    return {"rounds": len(rounds), **means}


def run(args: argparse.Namespace) -> dict[str, Any]:
    widest = max(args.sessions)
    prompt_list = prompts(args.target, args.reps * widest)
    stack_args = stack_namespace(args, args.setting)
    out: dict[str, Any] = {}
    with (
        TraceReceiver() as receiver,
        traced_environment(receiver),
        serving_stack(stack_args, {"separate": orchestrator_setting(args)}) as st,
    ):
        address = st.orchestrators["separate"].address
        traced_batch(address, receiver, prompt_list[:widest], 8)  # warm-up, untimed
        for n in args.sessions:
            reps = []
            for rep in range(args.reps):
                batch = prompt_list[rep * widest : rep * widest + n]
                reps.append(summarize(traced_batch(address, receiver, batch, args.new_tokens)))
                print(f"{n} sessions, rep {rep}: {reps[-1]}", flush=True)
            means = [r["round_ms"] for r in reps if r["rounds"]]
            every = [r for r in reps if r["rounds"]]
            out[str(n)] = {
                "reps": reps,
                "hop_ms": statistics.fmean(r["hop_ms"] for r in every) if every else None,
                "saved_ms": statistics.fmean(r["saved_ms"] for r in every) if every else None,
                "round_ms": statistics.fmean(means) if means else None,
                "round_spread_ms": max(means) - min(means) if len(means) > 1 else None,
            }
    return out


def headline(results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """By sessions: the most forwarding saves a round, beside the round and the spread
    between repetitions it must beat."""
    keys = ("saved_ms", "round_ms", "round_spread_ms")
    return {n: {k: r[k] for k in keys} for n, r in results.items()}


def markdown(results: dict[str, Any], args: argparse.Namespace, env: dict, argv: list[str]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        "# What forwarding the proposal draft -> target could save",
        "",
        f"Emulated devices draft {args.setting.draft_ms:g} ms / target "
        f"{args.setting.target_ms:g} ms per forward, tiny pair, adaptive, "
        f"{args.new_tokens} tokens per request, {args.reps} repetitions; the drafting "
        "decode rounds of traced requests.",
        "",
        "| sessions | drafting rounds | round ms | spread between reps ms | hop ms (bound) "
        "| saved ms (estimate) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, r in results.items():
        rounds = sum(x["rounds"] for x in r["reps"])
        lines.append(
            f"| {n} | {rounds} | {ms(r['round_ms'])} | {ms(r['round_spread_ms'])} "
            f"| {ms(r['hop_ms'])} | {ms(r['saved_ms'])} |"
        )
    lines += ["", environment_md(env), "", f"Reproduce: `{reproduce_command(argv[0], argv[1:])}`"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv_list = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", type=Setting.parse, default=Setting(2.0, 12.0))
    p.add_argument("--sessions", type=int_list, default=[1, 8])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--target", default="tiny:3")
    p.add_argument("--draft", default="tiny:3:noise=0.3")
    p.add_argument("--target-dtype", default="float32")
    p.add_argument("--draft-dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--target-timeout-s", type=float, default=600.0)
    add_deployment_flags(p)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv_list)
    if args.reps < 1 or args.new_tokens < 2 or not args.sessions or min(args.sessions) < 1:
        p.error("--reps >= 1, --new-tokens >= 2 and --sessions >= 1, please")
    results = run(args)
    env = environment()
    md = markdown(results, args, env, ["bench.experiments.forwarding_hop", *argv_list])
    print(md)
    data = {
        "headline": headline(results),
        "results": results,
        "args": {**vars(args), "setting": args.setting.label},
    }
    if not args.no_write:
        write_results("forwarding_hop", md, {**data, "environment": env})
    return data


if __name__ == "__main__":
    main()
