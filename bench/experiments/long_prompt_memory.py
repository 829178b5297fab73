"""Peak memory and time of one long prefill, chunked (``--prefill-chunk-tokens``) or not.

Each (prompt length, chunk size) runs in a fresh child process that loads the model,
reserves the KV for the prompt and runs one prefill forward of random token ids; it
reports its resident-set high-water mark growth over the forward (``ru_maxrss``) and
the forward's wall time. The child's address space is capped (``--max-gib``, via
``RLIMIT_AS``), so an unchunked prefill whose attention asks for tens of GB fails
with an out-of-memory error in that child, reported as such, instead of taking the
machine's memory.

    python -m bench.experiments.long_prompt_memory --model qwen2.5-coder-1.5b-instruct \\
        --tokens 2048,8192,16384,32768 --chunks 0,512 --max-gib 24

writes ``bench/results/long_prompt_memory.{md,json}`` (``--no-write``: print only).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.common import environment, environment_md, reproduce_command, write_results

NAME = "long_prompt_memory"


def child(model_spec: str, dtype: str, tokens: int, chunk: int, threads: int) -> dict[str, Any]:
    """One prefill in this process (the child): peak RSS growth and time."""
    import torch

    from specserve.engine.model import SeqInput
    from specserve.local import load

    torch.set_num_threads(threads)
    model = load(model_spec, dtype).model
    model.prefill_chunk_tokens = chunk or None
    vocab = model.config.vocab_size
    element = torch.empty((), dtype=model.activation_dtype).element_size()
    per_token = model.config.kv_bytes_per_token * element // 4  # the config counts 4 bytes
    kv = model.new_kv_pool(per_token * (tokens + 64))
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    kv.reserve({"s": tokens})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    try:
        model([SeqInput("s", ids, 1)], kv)
    except (MemoryError, RuntimeError) as e:  # the address-space cap: the attention's ask
        return {"tokens": tokens, "chunk": chunk, "error": f"{type(e).__name__}: {e}"[:300]}
    seconds = time.perf_counter() - t0
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"tokens": tokens, "chunk": chunk, "seconds": seconds, "peak_growth_mib": grown / 1024}


def run_one(args: argparse.Namespace, tokens: int, chunk: int) -> dict[str, Any]:
    """:func:`child` in a fresh process under the address-space cap."""
    cap = int(args.max_gib * (1 << 30))
    command = [
        sys.executable,
        "-m",
        "bench.experiments.long_prompt_memory",
        "--child",
        json.dumps([args.model, args.dtype, tokens, chunk, args.threads]),
    ]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    done = subprocess.run(command, capture_output=True, text=True, preexec_fn=limit, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout)[-300:]
        return {"tokens": tokens, "chunk": chunk, "error": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def table(rows: Sequence[dict[str, Any]]) -> str:
    out = ["| prompt tokens | chunk | prefill s | peak RSS growth |", "| --- | --- | --- | --- |"]
    for r in rows:
        chunk = r["chunk"] or "off"
        if "error" in r:
            out.append(f"| {r['tokens']} | {chunk} | - | failed: {r['error'][:80]} |")
        else:
            growth = f"+{r['peak_growth_mib']:.0f} MiB"
            out.append(f"| {r['tokens']} | {chunk} | {r['seconds']:.2f} | {growth} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.experiments.long_prompt_memory", description=__doc__
    )
    parser.add_argument("--model", default="tiny:3")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", default="1024,4096,8192", help="prompt lengths")
    parser.add_argument("--chunks", default="0,512", help="chunk sizes (0: one forward)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-gib", type=float, default=16.0, help="each child's address space")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*json.loads(args.child))), flush=True)
        return 0
    rows = [
        run_one(args, int(n), int(c))
        for n in args.tokens.split(",")
        for c in args.chunks.split(",")
    ]
    env = environment()
    command = reproduce_command("bench.experiments.long_prompt_memory", list(argv or sys.argv[1:]))
    md = "\n\n".join(
        [
            f"# Long prompt memory: {args.model} ({args.dtype})",
            table(rows),
            environment_md(env),
            f"Reproduce: `{command}`",
        ]
    )
    print(md)
    if not args.no_write:
        write_results(NAME, md, {"model": args.model, "rows": rows, "environment": env})
    return 0


if __name__ == "__main__":
    sys.exit(main())
