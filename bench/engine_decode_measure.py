"""What :mod:`bench.engine_decode` times: greedy decodes, forwards by token count, products.

* :func:`decode_prompts` — greedy decoding of every prompt by the engine
  (:func:`engine_decode`) and by each transformers variant (:func:`hf_decode`), the
  order rotating from prompt to prompt; every step is stamped, prefill apart;
* :func:`forward_costs` — one forward of each of :data:`FORWARD_SIZES` new tokens
  after a cached context (logits for all of them, as a verify step needs), engine
  with and without its CPU kernels, transformers, and the step's matrix products
  alone (:func:`products`), interleaved;
* :func:`page_size_ab` — the same products on huge pages against a 4 KiB-page copy.
"""

from __future__ import annotations

import copy
import gc
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import Samples, interleave
from bench.engine_decode_models import ENGINE, Models
from specserve.engine import ops
from specserve.engine.model import CausalLM, SeqInput

FORWARD_SIZES = (1, 2, 4, 5, 6, 9)
SESSION = "bench"
PAGE_AB_LAYERS = 4  # layers copied onto 4 KiB pages for the page-size comparison


@dataclass
class Decode:
    """One greedy decode: the new tokens, seconds between them, prefill seconds."""

    tokens: list[int]
    steps_s: list[float]  # [new_tokens - 1] time of each one-token forward (+ argmax)
    prefill_s: float  # prompt forward up to the first new token

    @property
    def per_token_s(self) -> float:
        """Median step: robust to the bursts of other jobs on a shared machine."""
        return statistics.median(self.steps_s)

    @property
    def mean_s(self) -> float:
        """First to last new token over the number of steps."""
        return sum(self.steps_s) / len(self.steps_s)


def _decode(tokens: list[int], stamps: list[float], start: float) -> Decode:
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    return Decode(tokens, steps, stamps[0] - start)


def _kv_budget(model: CausalLM, tokens: int) -> int:
    per_token = model.config.kv_bytes_per_token * model.dtype.itemsize // 4
    return per_token * (tokens + 64)


def engine_decode(model: CausalLM, prompt: Sequence[int], new_tokens: int) -> Decode:
    """Greedy target-only decoding in the engine: prefill, then one token per forward."""
    kv = model.new_kv_pool(budget_bytes=_kv_budget(model, len(prompt) + new_tokens))
    kv.reserve({SESSION: len(prompt) + new_tokens})
    start = time.perf_counter()
    logits = model([SeqInput(SESSION, list(prompt))], kv)
    tokens = [int(logits[0].argmax())]
    stamps = [time.perf_counter()]
    for _ in range(new_tokens - 1):
        logits = model([SeqInput(SESSION, tokens[-1:])], kv)
        tokens.append(int(logits[0].argmax()))
        stamps.append(time.perf_counter())
    return _decode(tokens, stamps, start)


def hf_decode(hf: Any, prompt: Sequence[int], new_tokens: int) -> Decode:
    """Greedy ``generate`` with exactly ``new_tokens`` new tokens, stamped per step."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):  # called once per generated token, after its forward
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor([list(prompt)])
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([Stamp()]),
        )
    assert len(stamps) == new_tokens, (len(stamps), new_tokens)
    return _decode(out[0, len(prompt) :].tolist(), stamps, start)


def decode_prompts(
    models: Models,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    after_prompt: Callable[[int, dict[str, list[Decode]]], object],
) -> dict[str, list[Decode]]:
    """Every prompt decoded by the engine and each transformers variant, the order
    rotating from prompt to prompt; ``after_prompt(i, runs)`` runs after prompt ``i``."""
    names = [ENGINE, *models.transformers]
    runs: dict[str, list[Decode]] = {name: [] for name in names}
    for i, ids in enumerate(prompts):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            gc.collect()
            if name == ENGINE:
                runs[name].append(engine_decode(models.engine, ids, new_tokens))
            else:
                runs[name].append(hf_decode(models.transformers[name], ids, new_tokens))
        after_prompt(i, runs)
    return runs


def products(
    layers: Sequence[Any], lm_head: torch.Tensor | None, rows: int, kernels: bool
) -> Callable[[], None]:
    """A callable running every matrix product of one step for ``rows`` tokens, alone."""
    first = layers[0]
    x = torch.randn(rows, first.self_attn.q_proj.weight.shape[1])
    xi = torch.randn(rows, first.mlp.down_proj.weight.shape[1])

    def run() -> None:
        with torch.inference_mode(), ops.kernels_enabled(kernels):
            for layer in layers:
                a, m = layer.self_attn, layer.mlp
                ws = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
                ops.linears(x, ws, [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
                ops.linear(x, a.o_proj.weight)
                if kernels:
                    ops.gate_up_silu(x, m.gate_proj.weight, m.up_proj.weight)
                else:  # what the engine runs with the kernels off
                    F.silu(F.linear(x, m.gate_proj.weight)) * F.linear(x, m.up_proj.weight)
                ops.linear(xi, m.down_proj.weight)
            if lm_head is not None:
                ops.linear(x, lm_head)

    return run


def forward_costs(
    models: Models, context: Sequence[int], reps: int
) -> dict[str, dict[int, Samples]]:
    """Seconds of one forward of n new tokens after ``len(context)`` cached, per variant."""
    from transformers import DynamicCache

    model = models.engine
    n_max = max(FORWARD_SIZES)
    kv = model.new_kv_pool(budget_bytes=_kv_budget(model, len(context) + n_max))
    kv.reserve({SESSION: len(context) + n_max})
    model([SeqInput(SESSION, list(context), num_logits=0)], kv)
    caches = {}
    for name, hf in models.transformers.items():
        caches[name] = DynamicCache(config=hf.config)
        with torch.inference_mode():
            hf(torch.tensor([list(context)]), past_key_values=caches[name], use_cache=True)
    new = list(context[:n_max])  # any tokens will do; the cost does not depend on them

    def engine(n: int, kernels: bool) -> Callable[[], object]:
        def run() -> None:
            with ops.kernels_enabled(kernels):
                model([SeqInput(SESSION, new[:n], num_logits=n)], kv)

        return run

    def transformers(name: str, n: int) -> Callable[[], object]:
        hf, cache = models.transformers[name], caches[name]

        def run() -> None:
            with torch.inference_mode():
                hf(torch.tensor([new[:n]]), past_key_values=cache, use_cache=True)

        return run

    def roll_back(key: str) -> None:  # untimed: back to the context after every forward
        name, n = key.split("/")
        if name in caches:
            caches[name].crop(-int(n))
        elif name.startswith(ENGINE):
            kv.truncate(SESSION, len(context))
            kv.reserve({SESSION: n_max})

    layers, head = list(model.model.layers), model.lm_head.weight
    variants: dict[str, Callable[[], object]] = {}
    for n in FORWARD_SIZES:
        variants[f"{ENGINE}/{n}"] = engine(n, True)
        variants[f"{ENGINE}-torch/{n}"] = engine(n, False)
        for name in models.transformers:
            variants[f"{name}/{n}"] = transformers(name, n)
        variants[f"products/{n}"] = products(layers, head, n, kernels=True)
        variants[f"products-torch/{n}"] = products(layers, head, n, kernels=False)
    samples = interleave(variants, reps=reps, warmup=1, after_each=roll_back)
    out: dict[str, dict[int, Samples]] = {}
    for key, s in samples.items():
        name, n = key.split("/")
        out.setdefault(name, {})[int(n)] = s
    return out


def page_size_ab(model: CausalLM, reps: int) -> tuple[dict[str, Samples], int]:
    """1-row products of the first layers on huge pages (as loaded) vs a 4 KiB-page copy."""
    layers = list(model.model.layers[:PAGE_AB_LAYERS])
    nbytes = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    copies = [copy.deepcopy(layer) for layer in layers]  # torch's allocator: 4 KiB pages
    variants = {
        "huge pages": products(layers, None, 1, kernels=True),
        "4 KiB pages": products(copies, None, 1, kernels=True),
    }
    return interleave(variants, reps=reps, warmup=1), nbytes


def context_ids(tokenize: Callable[[str], list[int]], prompts: list[str], length: int) -> list[int]:
    """The first ``length`` token ids of the prompts laid end to end."""
    ids: list[int] = []
    for p in prompts:
        ids += tokenize(p)
        if len(ids) >= length:
            return ids[:length]
    raise ValueError(f"the prompts hold fewer than {length} tokens")
