"""A load run with guidellm against the OpenAI HTTP API: speculation on vs off at 1, 4, 8 users.

guidellm (the vLLM project's load generator, from the package index) is run as an
outside client of ``specserve http-server``: ``/v1/completions`` streamed, synthetic
prompts of ``--prompt-tokens`` tokens (made by guidellm from the target's tokenizer,
read from disk: nothing is downloaded), ``--output-tokens`` new tokens with
``ignore_eos`` so every request generates the same count, greedy. At each
concurrency the two settings alternate (on, off; then off, on at the next level),
each a guidellm ``concurrent`` profile of ``--requests`` requests:

* ``on``: ``"speculation": {"drafter": "model"}`` (adaptive k);
* ``off``: ``"speculation": {"drafter": "none"}`` (plain batched decoding, same path).

From guidellm's JSON reports the table takes time to first token, inter-token
latency and output tokens/s (medians and means as guidellm computes them) side by
side, and the headline is on/off output throughput per concurrency.

guidellm pulls a CUDA build of torch: install it in a venv of its own, never the
project's, and pass its executable:

    python -m venv ../guidellm-venv && ../guidellm-venv/bin/pip install guidellm
    .venv/bin/python -m bench.load_run --guidellm ../guidellm-venv/bin/guidellm \\
        --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --draft-dtype bfloat16 --threads 2

Writes bench/results/load_run.{md,json} (``--name`` changes the stem): the figures and
guidellm's TTFT and ITL percentiles per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import environment, environment_md, reproduce_command, write_results
from bench.http_stack import MODEL_NAME, add_stack_arguments, http_stack
from specserve.engine.loader import load_tokenizer
from specserve.model_store import resolve

SETTINGS = {"on": {"drafter": "model"}, "off": {"drafter": "none"}}


def guidellm_command(
    args: argparse.Namespace, base_url: str, tokenizer: str, setting: str, streams: int, out: Path
) -> list[str]:
    backend = {
        "kind": "openai_http",
        "target": base_url,
        "model": MODEL_NAME,
        "request_format": "/v1/completions",
        "http2": False,
        "timeout": 1800,
        "extras": {
            "body": {
                "speculation": SETTINGS[setting],
                "ignore_eos": True,
                "temperature": 0,
            }
        },
    }
    data = {
        "kind": "synthetic_text",
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
    }
    return [
        args.guidellm,
        "run",
        "--backend",
        json.dumps(backend),
        "--profile",
        json.dumps({"kind": "concurrent", "streams": [streams]}),
        "--constraint",
        json.dumps({"kind": "max_requests", "count": args.requests}),
        "--data",
        json.dumps(data),
        "--tokenizer",
        json.dumps({"kind": "huggingface_auto", "model": tokenizer}),
        "--seed",
        json.dumps({"kind": "static", "value": 42}),
        "--output",
        json.dumps({"kind": "json", "path": str(out)}),
        "--disable-console-interactive",
    ]


def figures(report: dict[str, Any]) -> dict[str, float]:
    """The figures the table shows, from one guidellm JSON report (one benchmark)."""
    (bench,) = report["benchmarks"]
    m = bench["metrics"]

    def ok(name: str) -> dict[str, Any]:
        return dict(m[name]["successful"])

    return {
        "requests_ok": m["request_totals"]["successful"],
        "requests_failed": m["request_totals"]["errored"] + m["request_totals"]["incomplete"],
        "ttft_p50_ms": ok("time_to_first_token_ms")["median"],
        "ttft_p95_ms": ok("time_to_first_token_ms")["percentiles"]["p95"],
        "itl_p50_ms": ok("inter_token_latency_ms")["median"],
        "itl_mean_ms": ok("inter_token_latency_ms")["mean"],
        "tpot_p50_ms": ok("time_per_output_token_ms")["median"],
        "ttft_ms_percentiles": ok("time_to_first_token_ms")["percentiles"],
        "itl_ms_percentiles": ok("inter_token_latency_ms")["percentiles"],
        "output_tokens_per_s": ok("output_tokens_per_second")["mean"],
        "output_tokens": ok("output_token_count")["total_sum"],
        "duration_s": bench["duration"],
    }


def markdown(rows: dict[str, dict[str, Any]], args: argparse.Namespace, env: dict[str, Any]) -> str:
    lines = [
        "# Load run: guidellm through the OpenAI HTTP API, speculation on vs off",
        "",
        f"guidellm `concurrent` profile, {args.requests} requests per cell, "
        f"`/v1/completions` streamed, synthetic prompts of {args.prompt_tokens} tokens, "
        f"{args.output_tokens} new tokens (`ignore_eos`), greedy; models {args.target} / "
        f"{args.draft}; settings alternated at each level.",
        "",
        "| users | setting | output tok/s | TTFT p50 / p95 ms | ITL p50 / mean ms "
        "| TPOT p50 ms | ok / failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, by_setting in rows.items():
        for setting in ("on", "off"):
            f = by_setting[setting]
            lines.append(
                f"| {c} | {setting} | {f['output_tokens_per_s']:.1f} | "
                f"{f['ttft_p50_ms']:.0f} / {f['ttft_p95_ms']:.0f} | "
                f"{f['itl_p50_ms']:.1f} / {f['itl_mean_ms']:.1f} | {f['tpot_p50_ms']:.1f} | "
                f"{f['requests_ok']} / {f['requests_failed']} |"
            )
        on, off = by_setting["on"], by_setting["off"]
        ratio = on["output_tokens_per_s"] / off["output_tokens_per_s"]
        lines.append(f"| {c} | **on / off** | **{ratio:.2f}x** | | | | |")
    lines += [
        "",
        "ITL under speculation is bursty (a round commits several tokens in one SSE event), "
        "so its median is small and its mean carries the rounds; TPOT is "
        "(request latency - TTFT) / (output tokens - 1) per request.",
        "",
        "## Environment",
        "",
        environment_md(env),
        "",
        "## Reproduce",
        "",
        "```",
        reproduce_command("bench.load_run"),
        "```",
    ]
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load_run", description=__doc__)
    add_stack_arguments(p)
    p.add_argument("--guidellm", default="guidellm", help="the guidellm executable")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 8])
    p.add_argument("--requests", type=int, default=24, help="requests per (setting, level)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--name", default="load_run", help="results file stem")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    env = environment()
    offline = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    rows: dict[str, dict[str, Any]] = {}
    version = subprocess.run([args.guidellm, "--version"], capture_output=True, text=True)
    with tempfile.TemporaryDirectory(prefix="specserve-load-") as tmp, http_stack(args) as s:
        tokenizer = s.tokenizer if s.tokenizer.startswith("/") else str(resolve(s.tokenizer))
        if Path(tokenizer).is_file():  # a GGUF file: guidellm reads a tokenizer directory
            saved = Path(tmp) / "tokenizer"
            load_tokenizer(Path(tokenizer)).hf.save_pretrained(saved)
            tokenizer = str(saved)
        for i, c in enumerate(args.concurrency):
            order = ("on", "off") if i % 2 == 0 else ("off", "on")
            for setting in order:
                out = Path(tmp) / f"{setting}-{c}.json"
                cmd = guidellm_command(args, f"{s.base_url}", tokenizer, setting, c, out)
                done = subprocess.run(cmd, env=offline, capture_output=True, text=True)
                if done.returncode != 0:
                    print(done.stdout[-4000:], done.stderr[-4000:], file=sys.stderr)
                    raise SystemExit(f"guidellm failed ({done.returncode}) at {setting}/{c}")
                report = json.loads(out.read_text())
                rows.setdefault(str(c), {})[setting] = figures(report)
    md = markdown(rows, args, env)
    print(md)
    if not args.no_write:
        headline = {
            "on_over_off_output_tokens_per_s": {
                c: round(r["on"]["output_tokens_per_s"] / r["off"]["output_tokens_per_s"], 3)
                for c, r in rows.items()
            }
        }
        data = {
            "headline": headline,
            "rows": rows,
            "guidellm": version.stdout.strip(),
            "args": {**vars(args), "guidellm": Path(args.guidellm).name},
            "environment": env,
        }
        write_results(args.name, md, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
