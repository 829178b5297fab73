"""A long prompt beside decoding streams: the streams' largest gap and the prompt's first token.

One stack (:mod:`bench.serving_stack`: a target and a draft server on this machine's
cores, devices declared shared) and two orchestrators over it, run one at a time:

1. **one round**: ``--max-prefill-tokens`` past the prompt, on a lane that has measured
   nothing, so the prompt is prefilled in one round. The prompt goes alone; its time to
   first token is the one-round figure (every stream on the target would wait about
   that long: docs/scheduling.md);
2. **chunked** (the defaults): ``--streams`` streams decode (plain, ``ignore_eos``,
   restarted when one ends); after ``--warm-tokens`` tokens each, ``--normal-s`` seconds
   of their gaps give the normal gap (median); then the long prompt (another one of the
   same length) arrives, and its time to first token and the streams' largest gap
   while it prefills are taken; then the streams decode alone for as long as the
   prefill took, and their largest gap there is the host's own (what no scheduling
   removes).

Gaps are between consecutive deltas of one request (a stream's restart is not a gap).
The prompt is random token ids (``--vocab-low`` .. ``--vocab-high``), greedy, 8 new
tokens, drafter none.

    .venv/bin/python -m bench.experiments.long_prompt_fairness --tokens 32768          # tiny models
    .venv/bin/python -m bench.experiments.long_prompt_fairness \\
        --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --tokens 3000 --name long_prompt_fairness_real

Writes bench/results/NAME.{md,json}; the JSON's ``headline`` has the figures.
"""

from __future__ import annotations

import argparse
import itertools
import random
import re
import statistics
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import environment, environment_md, reproduce_command, write_results
from bench.serving_stack import OrchestratorSetting, serving_stack
from specserve.client import Client

SHORT = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8], [1, 6, 1, 8, 0, 3, 3, 9]]


class Streamer(threading.Thread):
    """Streams requests one after another until stopped; notes each delta's arrival."""

    def __init__(self, address: str, prompt: list[int], tokens: int) -> None:
        super().__init__(daemon=True)
        self.address, self.prompt, self.tokens = address, prompt, tokens
        self.requests: list[list[float]] = []  # per request: arrival time of each delta
        self.error: Exception | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            with Client(self.address, timeout_s=3600) as c:
                while not self.stopping.is_set():
                    times: list[float] = []
                    self.requests.append(times)
                    stream = c.stream(
                        self.prompt, max_new_tokens=self.tokens, drafter="none", ignore_eos=True
                    )
                    for _ in stream:
                        times.append(time.monotonic())
                        if self.stopping.is_set():
                            stream.cancel()
                            return
        except Exception as e:
            self.error = e

    def count(self) -> int:
        return sum(len(t) for t in self.requests)

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive deltas of a request whose later delta came in
        ``start .. end``."""
        return [
            b - a
            for times in self.requests
            for a, b in itertools.pairwise(list(times))
            if start < b <= end
        ]


def long_prompt(args: argparse.Namespace, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(args.vocab_low, args.vocab_high) for _ in range(args.tokens)]


def one_round(address: str, args: argparse.Namespace) -> float:
    """The long prompt alone, prefilled in one round: seconds to its first token (after
    a short request that warms the target: its first call may build its kernels)."""
    with Client(address, timeout_s=3600) as c:
        c.generate(SHORT[0], max_new_tokens=8, drafter="none")
        return c.generate(
            long_prompt(args, 1), max_new_tokens=8, drafter="none"
        ).time_to_first_token_s


def chunked(address: str, args: argparse.Namespace, metrics_port: int) -> dict[str, Any]:
    """The long prompt beside ``args.streams`` decoding streams (the module docstring)."""
    streams = [
        Streamer(address, SHORT[i % len(SHORT)], args.stream_tokens) for i in range(args.streams)
    ]
    for s in streams:
        s.start()
    while min(s.count() for s in streams) < args.warm_tokens:
        if any(s.error for s in streams):
            raise RuntimeError(f"a stream failed: {[s.error for s in streams]}")
        time.sleep(0.01)
    normal_from = time.monotonic()
    time.sleep(args.normal_s)
    t0 = time.monotonic()
    with Client(address, timeout_s=3600) as c:
        done = c.generate(long_prompt(args, 2), max_new_tokens=8, drafter="none")
    t1 = time.monotonic()
    time.sleep(t1 - t0)  # the streams alone, as long again
    t2 = time.monotonic()
    for s in streams:
        s.stopping.set()
    for s in streams:
        s.join(timeout=60)
    if any(s.error for s in streams):
        raise RuntimeError(f"a stream failed: {[s.error for s in streams]}")
    normal = statistics.median(g for s in streams for g in s.gaps(normal_from, t0))
    during = max(g for s in streams for g in s.gaps(t0, t1))
    alone = max(g for s in streams for g in s.gaps(t1, t2))
    return {
        "normal_gap_ms": normal * 1e3,
        "largest_gap_ms": during * 1e3,
        "largest_over_normal": during / normal,
        "alone_largest_gap_ms": alone * 1e3,
        "alone_largest_over_normal": alone / normal,
        "ttft_s": done.time_to_first_token_s,
        "prefill_s": t1 - t0,
        "chunks": prefill_chunks(metrics_port),
    }


def prefill_chunks(port: int) -> float:
    """Chunk rounds an orchestrator ran, from its metrics port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    found = re.search(
        r"^specserve_orchestrator_prefill_chunks(?:_total)?(?:\{[^}]*\})? (\S+)$", body, re.M
    )
    return float(found.group(1)) if found else 0.0


def markdown(args: argparse.Namespace, head: dict[str, Any], env: dict[str, Any], cmd: str) -> str:
    return "\n".join(
        [
            f"# A {args.tokens:,}-token prompt beside {args.streams} decoding streams",
            "",
            f"Target `{args.target}`, draft `{args.draft}`, {args.threads} torch thread(s) a "
            "server, devices shared. Gaps are between consecutive tokens of one stream.",
            "",
            "| | figure |",
            "| --- | --- |",
            f"| the streams' normal gap (median) | {head['normal_gap_ms']:.1f} ms |",
            f"| their largest gap while it prefills, chunked | {head['largest_gap_ms']:.1f} ms "
            f"({head['largest_over_normal']:.1f}x) |",
            f"| their largest gap alone, as long again | {head['alone_largest_gap_ms']:.1f} ms "
            f"({head['alone_largest_over_normal']:.1f}x) |",
            f"| its time to first token, chunked ({head['chunks']:.0f} chunk rounds) | "
            f"{head['ttft_s']:.2f} s |",
            f"| its time to first token in one round, alone (the others would wait about "
            f"this long) | {head['one_round_ttft_s']:.2f} s |",
            "",
            "Load average (1, 5, 15 min) at the end: "
            f"{', '.join(f'{x:.2f}' for x in env['load_average'] or ())} on "
            f"{env['logical_cpus']} logical CPUs (other jobs share the machine).",
            "",
            f"Reproduce: `{cmd}`",
            "",
            environment_md(env),
        ]
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="tiny:3")
    p.add_argument("--draft", default="tiny:3:noise=0.3")
    p.add_argument("--target-dtype", default="float32")
    p.add_argument("--draft-dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads per server")
    p.add_argument("--tokens", type=int, default=32_768, help="the long prompt's tokens")
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--stream-tokens", type=int, default=4000, help="max_new_tokens of a stream")
    p.add_argument("--warm-tokens", type=int, default=100, help="tokens a stream decodes first")
    p.add_argument("--normal-s", type=float, default=1.0, help="seconds of normal gaps")
    p.add_argument("--vocab-low", type=int, default=0)
    p.add_argument("--vocab-high", type=int, default=256)
    p.add_argument("--kv-budget", default="64MiB", help="the target's --kv-budget")
    p.add_argument("--target-timeout-s", type=float, default=600.0)
    p.add_argument("--logs", type=Path, default=None, help="folder for every process's output")
    p.add_argument("--name", default="long_prompt_fairness", help="results file stem")
    p.add_argument("--no-write", action="store_true", help="print, do not write results")
    args = p.parse_args(argv)
    args.emulate_devices = None
    args.target_flags = ["--kv-budget", args.kv_budget]
    args.draft_flags = ["--kv-budget", args.kv_budget]
    settings = {
        "one_round": OrchestratorSetting(("--max-prefill-tokens", str(args.tokens + 64))),
        "chunked": OrchestratorSetting(),
    }
    with serving_stack(args, settings) as stack:
        head = {"tokens": args.tokens, "streams": args.streams}
        head["one_round_ttft_s"] = one_round(stack.orchestrators["one_round"].address, args)
        head |= chunked(
            stack.orchestrators["chunked"].address, args, stack.metrics_ports["chunked"]
        )
    env = environment()
    cmd = reproduce_command(
        "bench.experiments.long_prompt_fairness", list(argv) if argv is not None else None
    )
    md = markdown(args, head, env, cmd)
    print(md)
    data = {
        "headline": head,
        "args": {k: str(v) for k, v in vars(args).items()},
        "environment": env,
    }
    if not args.no_write:
        write_results(args.name, md, data)
    return data


if __name__ == "__main__":
    main()
