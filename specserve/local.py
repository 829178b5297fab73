"""Local mode: the target, the drafters and the speculative loop in one process.

Used by ``specserve generate --local``, the benchmarks and the slow end-to-end
tests. Models are named by a store name (``specserve models list``), a local
directory, a GGUF file, or ``tiny:<seed>`` for a random test model
(:class:`specserve.engine.model_spec.ModelSpec`), loaded through the engine's loader.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from specserve import model_store
from specserve.engine.decode_state import DecodeState, FinishReason, SessionStats, StopCriteria
from specserve.engine.devices import check_device_name, parse_device
from specserve.engine.draft_vocab import DEFAULT_DRAFT_VOCAB, reduce_draft_head
from specserve.engine.drafter import Drafter, DrafterKind
from specserve.engine.dtypes import DTYPES
from specserve.engine.loader import LoadedModel, check_compatible, load_spec, load_spec_tokenizer
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.ngram import NgramDrafter
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.step_runner import StepOptions
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy
from specserve.policy.round_cost import RoundCosts


@dataclass(frozen=True)
class LocalConfig:
    """Everything local mode needs, built once from CLI flags."""

    target: str
    draft: str | None = None
    target_dtype: str = "float32"
    draft_dtype: str = "bfloat16"  # as the draft server: the output does not depend on it
    target_device: str = "cpu"  # cpu, cuda or cuda:N (engine.devices)
    draft_device: str = "cpu"
    kv_budget_bytes: int = 2 << 30
    draft_kv_budget_bytes: int = 1 << 30
    threads: int | None = None
    min_confidence: float = 0.0
    draft_vocab: int = DEFAULT_DRAFT_VOCAB  # tokens the draft's head scores (0: all)
    # Adaptive k plans with the round costs this loop measures (not the static guess).
    measured_costs: bool = True

    def __post_init__(self) -> None:
        for name in (self.target_dtype, self.draft_dtype):
            if name not in DTYPES:
                raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
        for device in (self.target_device, self.draft_device):
            check_device_name(device)


@dataclass
class Completion:
    """One generated completion and how it was produced."""

    prompt_tokens: int
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    seconds: float
    stats: SessionStats

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.stats.acceptance_rate

    @property
    def mean_acceptance_length(self) -> float:
        return self.stats.mean_acceptance_length

    def summary(self) -> str:
        return (
            f"{len(self.tokens)} tokens in {self.seconds:.2f} s: "
            f"{self.tokens_per_second:.2f} tok/s | {self.stats.rounds} rounds | "
            f"acceptance {100 * self.acceptance_rate:.1f}% | "
            f"mean acceptance length {self.mean_acceptance_length:.2f} | "
            f"finish {self.finish_reason.value}"
        )


def load(spec: str, dtype: str, device: str = "cpu", *, tokenizer: bool = True) -> LoadedModel:
    """Load a model onto ``device`` and its tokenizer (None for tiny random models, or
    ``tokenizer`` False), as the servers do."""
    return load_spec(
        spec, dtype, locate=model_store.locate, device=parse_device(device), tokenizer=tokenizer
    )


class LocalRunner:
    """A loaded model pair and the drafters built on it."""

    def __init__(self, config: LocalConfig) -> None:
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        # The pair rule first, from the tokenizers alone: a refused pair costs no weights.
        self.tokenizer = load_spec_tokenizer(config.target, locate=model_store.locate)
        draft_tok = None
        if config.draft:
            draft_tok = load_spec_tokenizer(config.draft, locate=model_store.locate)
            if self.tokenizer is not None and draft_tok is not None:
                check_compatible(draft_tok, self.tokenizer)
        loaded = load(config.target, config.target_dtype, config.target_device, tokenizer=False)
        loaded = replace(loaded, tokenizer=self.tokenizer)
        self.target = loaded.model
        # Embedding matrices are padded past the tokenizer; those ids are never tokens.
        vocab = loaded.vocab
        self.verifier = TargetVerifier(self.target, config.kv_budget_bytes, vocab_limit=vocab)
        drafters: dict[DrafterKind, Drafter] = {DrafterKind.NGRAM: NgramDrafter()}
        if config.draft:
            draft_loaded = load(
                config.draft, config.draft_dtype, config.draft_device, tokenizer=False
            )
            draft_loaded = replace(draft_loaded, tokenizer=draft_tok)
            draft = draft_loaded.model
            reduce_draft_head(draft, draft_tok, config.draft_vocab, min(vocab, draft_loaded.vocab))
            drafters[DrafterKind.MODEL] = ModelDrafter(
                draft,
                config.draft_kv_budget_bytes,
                min_confidence=config.min_confidence,
                vocab_limit=min(vocab, draft.config.vocab_size),
                steps=StepOptions() if draft.device.type == "cuda" else None,
            )
        costs = RoundCosts() if config.measured_costs else None
        self.engine = SpeculativeEngine(self.verifier, drafters, costs=costs)
        self._next_id = 0

    @property
    def eos_ids(self) -> frozenset[int]:
        ids = set(self.target.config.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return frozenset(ids)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``, by default without special tokens (without a tokenizer: the
        ids written out)."""
        if self.tokenizer is None:
            return "".join(f" {i}" for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        max_new_tokens: int = 128,
        drafter: DrafterKind | str = DrafterKind.MODEL,
        k: int | None = None,
        k_max: int = 8,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        on_text: Callable[[str], None] | None = None,
        skip_special_tokens: bool = True,
    ) -> Completion:
        """Decode one prompt; ``on_text`` receives text as tokens are committed, without
        special tokens unless ``skip_special_tokens`` is False (stop strings are matched
        in that same text)."""
        self._next_id += 1
        decode = functools.partial(self.decode, skip_special_tokens=skip_special_tokens)
        state = DecodeState(
            f"local-{self._next_id}",
            prompt,
            params,
            StopCriteria(max_new_tokens, frozenset() if ignore_eos else self.eos_ids, tuple(stop)),
            KPolicy(k, k_max=k_max),
            drafter=drafter,
            decode=decode if self.tokenizer is not None else None,
        )
        printed = [0]

        def stream(s: DecodeState, _new: list[int]) -> None:
            if on_text is None:
                return
            text = decode(s.completion)
            if s.text_end is not None:
                text = text[: s.text_end]
            elif text.endswith("\ufffd"):
                return  # a multi-byte character is still incomplete
            on_text(text[printed[0] :])
            printed[0] = len(text)

        t0 = time.perf_counter()
        self.engine.run([state], on_tokens=stream)
        seconds = time.perf_counter() - t0
        text = decode(state.completion)
        if state.text_end is not None:
            text = text[: state.text_end]
        assert state.finish_reason is not None
        return Completion(
            prompt_tokens=state.prompt_len,
            tokens=state.completion,
            text=text,
            finish_reason=state.finish_reason,
            seconds=seconds,
            stats=state.stats,
        )
