"""Target-side verification: one batched forward over (committed delta + drafts).

For every session the target runs the committed tokens it has not seen yet plus
the k draft tokens, computes p at the k + 1 positions, applies the acceptance rule
(:mod:`specserve.engine.rejection`) and rolls its KV back to the committed prefix
plus the accepted drafts. The recovered or bonus token is not in the cache yet: it
arrives as the first new token of the session's next round. A prefill is a verify
with no drafts.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from specserve.engine.config import ModelConfig
from specserve.engine.errors import InvalidArgument
from specserve.engine.kv_cache import KVStats
from specserve.engine.logprobs import TokenLogprob, token_logprobs
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.rejection import Proposal, Verdict, verify
from specserve.engine.sampling import SamplingParams
from specserve.engine.step_runner import StepOptions, StepRunner
from specserve.policy.plain_steps import MAX_STEPS

# TargetVerifier's default step options: static steps (CUDA graphs) on CUDA, eager elsewhere.
AUTO = "auto"


@dataclass(frozen=True)
class VerifyInput:
    """One session's part of a batched verify."""

    session_id: str
    start: int  # committed tokens the target should already hold
    new_tokens: Sequence[int]  # committed tokens from ``start`` on (at least one)
    proposal: Proposal
    params: SamplingParams
    round_index: int
    want_logprobs: bool = False
    top_logprobs: int | None = None  # None = no TokenLogprobs; else alternatives per token
    # Plain decoding steps: n > 1 decodes n tokens in one call, feeding each back in
    # (no drafts then; run by the target backend, step j drawing as round + j would).
    steps: int = 1

    def __post_init__(self) -> None:
        if self.start < 0:
            raise InvalidArgument(f"start must be >= 0, got {self.start}")
        if not 1 <= self.steps <= MAX_STEPS:
            raise InvalidArgument(f"steps must be 1..{MAX_STEPS}, got {self.steps}")
        if self.steps > 1 and self.proposal.tokens:
            raise InvalidArgument(
                f"session {self.session_id!r}: steps > 1 decodes without drafts; send "
                f"either draft tokens or steps, not both"
            )
        if not self.new_tokens:
            raise InvalidArgument(
                "a verify needs at least one new committed token (the last round's "
                "recovered or bonus token, or the prompt)"
            )

    @property
    def committed_len(self) -> int:
        return self.start + len(self.new_tokens)


@dataclass(frozen=True)
class VerifyOutcome:
    """A verdict, or ``stale=True`` when the target needs the full history."""

    verdict: Verdict | None
    stale: bool = False
    # log p of each emitted token (accepted drafts, then the next token), temperature 1
    logprobs: tuple[float, ...] = ()
    # when top_logprobs was asked for: one per emitted token, under the session's params
    token_logprobs: tuple[TokenLogprob, ...] = ()


class Verifier(Protocol):
    """What a target server calls: :class:`TargetVerifier` and the tensor-parallel
    verifiers (``target_service/tp_worker.py``, ``tp_ray.py``) alike."""

    vocab_limit: int  # token ids a request may name

    @property
    def config(self) -> ModelConfig: ...  # the model's config (its context, for the limits)

    @property
    def kv(self) -> Container[str]: ...  # ``session_id in verifier.kv``: a cache is held

    def verify(self, inputs: Sequence[VerifyInput]) -> list[VerifyOutcome]: ...

    def release(self, session_id: str) -> bool: ...

    def release_sessions(self, session_ids: Sequence[str]) -> frozenset[str]: ...  # had one

    def holding(self, session_ids: Sequence[str]) -> frozenset[str]: ...  # one call per batch

    def kv_stats(self) -> KVStats: ...

    def sessions(self) -> int: ...

    def healthy(self) -> bool: ...  # False once a rank failed or the group was closed

    def close(self) -> None: ...  # stop the rank group (a no-op for a single process)


class TargetVerifier:
    """Owns the target model's KV pool and runs batched verification."""

    def __init__(
        self,
        model: CausalLM,
        kv_budget_bytes: int,
        *,
        vocab_limit: int | None = None,
        steps: StepOptions | Literal["auto"] | None = AUTO,
    ) -> None:
        """``steps``: run decode and verify steps as static-shape steps
        (:mod:`specserve.engine.step_runner`; on CUDA captured as CUDA graphs here, at
        start) with these options; None runs every step on the eager forward; ``"auto"``
        is ``StepOptions()`` on CUDA and None elsewhere (a CPU keeps its eager path, which
        its kernels already make fast)."""
        self.model = model
        self.kv = model.new_kv_pool(kv_budget_bytes)
        self.vocab_limit = vocab_limit or model.config.vocab_size
        if steps == AUTO:
            steps = StepOptions() if model.device.type == "cuda" else None
        self.steps = None
        if isinstance(steps, StepOptions):
            self.steps = StepRunner.build_or_none(model, self.kv, steps, self.vocab_limit, "steps")

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def kv_stats(self) -> KVStats:
        return self.kv.stats()

    def sessions(self) -> int:
        return self.kv.stats().sessions

    def release(self, session_id: str) -> bool:
        return self.kv.release(session_id)

    def release_sessions(self, session_ids: Sequence[str]) -> frozenset[str]:
        """Drop the named sessions' caches; the ids that had one."""
        return frozenset(sid for sid in session_ids if self.kv.release(sid))

    def holding(self, session_ids: Sequence[str]) -> frozenset[str]:
        """Which of ``session_ids`` have a cache here (one call for a whole batch)."""
        return frozenset(sid for sid in session_ids if sid in self.kv)

    def healthy(self) -> bool:
        """Always True: a single-process verifier fails only by raising (as TP groups do too)."""
        return True

    def close(self) -> None:
        """Nothing to stop; a tensor-parallel verifier stops its rank group here."""

    def verify(self, inputs: Sequence[VerifyInput]) -> list[VerifyOutcome]:
        """Verify a batch; sessions with a stale cache are answered ``stale`` and skipped."""
        ids = [x.session_id for x in inputs]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("a verify batch names the same session twice")
        for x in inputs:
            for t in (*x.new_tokens, *x.proposal.tokens):
                if not 0 <= t < self.vocab_limit:
                    raise InvalidArgument(
                        f"token id {t} of session {x.session_id!r} is outside the "
                        f"vocabulary (0..{self.vocab_limit - 1})"
                    )
        live = [x for x in inputs if self._sync(x)]
        outcomes: dict[str, VerifyOutcome] = {
            x.session_id: VerifyOutcome(verdict=None, stale=True) for x in inputs
        }
        if live:
            self.kv.reserve(
                {x.session_id: len(x.new_tokens) + len(x.proposal.tokens) for x in live}
            )
            outcomes.update(self._run(live))
        return [outcomes[x.session_id] for x in inputs]

    def _sync(self, x: VerifyInput) -> bool:
        """Roll the cache back to ``start``; False when it holds fewer tokens."""
        if x.session_id not in self.kv:
            return x.start == 0
        have = self.kv.length(x.session_id)
        if have < x.start:
            return False
        self.kv.truncate(x.session_id, x.start)
        return True

    @torch.inference_mode()
    def _run(self, live: list[VerifyInput]) -> dict[str, VerifyOutcome]:
        seqs = [
            SeqInput(
                x.session_id,
                [*x.new_tokens, *x.proposal.tokens],
                num_logits=len(x.proposal.tokens) + 1,
            )
            for x in live
        ]
        if self.steps is not None and self.steps.takes(live):
            verdicts = self.steps.verify(live)  # (no logprobs asked: takes() checked)
            logits = torch.empty(0)
        else:
            logits = self.model(seqs, self.kv)[:, : self.vocab_limit]  # [sum(k_i + 1), vocab]
            verdicts = verify(
                logits,
                [x.proposal for x in live],
                [x.params for x in live],
                [x.round_index for x in live],
                [x.committed_len for x in live],
            )
        out: dict[str, VerifyOutcome] = {}
        row = 0
        for x, v in zip(live, verdicts, strict=True):
            self.kv.truncate(x.session_id, x.committed_len + v.accepted)
            logprobs: tuple[float, ...] = ()
            if x.want_logprobs:
                emitted = [*x.proposal.tokens[: v.accepted], v.next_token]
                rows = torch.log_softmax(logits[row : row + len(emitted)], dim=-1)
                picked = rows.gather(1, torch.tensor(emitted, device=rows.device)[:, None])
                logprobs = tuple(picked[:, 0].tolist())  # one read back, not one per token
            detailed: tuple[TokenLogprob, ...] = ()
            if x.top_logprobs is not None:
                n = v.accepted + 1
                emitted = [*x.proposal.tokens[: v.accepted], v.next_token]
                detailed = token_logprobs(logits[row : row + n], emitted, x.params, x.top_logprobs)
            out[x.session_id] = VerifyOutcome(v, logprobs=logprobs, token_logprobs=detailed)
            row += len(x.proposal.tokens) + 1
        return out
