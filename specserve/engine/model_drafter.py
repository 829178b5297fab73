"""Draft-model drafter: a small causal LM proposes k tokens per session.

Per session it tracks the tokens it knows (committed ones, then its own last
drafts) and how many of them are in its KV cache. A new request reuses every
cached token that the committed history confirms — drafts that the target
accepted are already in the cache — rolls back the rest, and feeds only what is
missing. All sessions of a request draft together: one batched forward per draft
position, sessions leaving the batch as they reach their k or lose confidence.

Sampled drafting draws from the draft's own truncated distribution (top
``max_support`` after the request's temperature/top-k/top-p) and returns exactly
that distribution as sparse q, which is what the acceptance rule needs to stay
exact. Greedy drafting returns point masses, and so does coupled drafting
(:mod:`specserve.engine.coupling`): it proposes argmax(log q + g) over the same
truncated q with the noise g(seed, position) the target uses, and the target needs
no q to judge it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specserve.engine import coupling, ops
from specserve.engine.drafter import DrafterKind, DraftInput, DraftOutcome
from specserve.engine.kv_cache import KVStats
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.randomness import Stream, uniform
from specserve.engine.rejection import Proposal
from specserve.engine.sampling import SamplingParams, probabilities


@dataclass
class _Session:
    tokens: list[int] = field(default_factory=list)  # committed tokens, then drafts
    committed: int = 0  # how many of ``tokens`` are committed
    in_kv: int = 0  # how many of ``tokens`` have K/V in the pool


@dataclass
class _Active:
    index: int  # position in the request
    sid: str
    k: int
    params: SamplingParams
    round_index: int
    feed: list[int]  # tokens to run in the next forward
    drafts: list[int] = field(default_factory=list)
    q_ids: list[torch.Tensor] = field(default_factory=list)  # [m] per draft
    q_probs: list[torch.Tensor] = field(default_factory=list)  # [m] per draft


class ModelDrafter:
    """Drafts with a :class:`CausalLM` over its own KV pool."""

    name = DrafterKind.MODEL

    def __init__(
        self,
        model: CausalLM,
        kv_budget_bytes: int,
        *,
        max_support: int = 64,
        min_confidence: float = 0.0,
        vocab_limit: int | None = None,
        bfloat16_prefill: bool | None = None,
    ) -> None:
        self.model = model
        if bfloat16_prefill is None:  # where bfloat16 products are fast and the weights are
            bfloat16_prefill = (
                model.dtype == torch.bfloat16
                and model.activation_dtype == torch.float32
                and model.device.type == "cpu"
                and ops.native_bfloat16()
            )
        self.bfloat16_prefill = bfloat16_prefill  # see ops.bfloat16_products
        self.kv = model.new_kv_pool(kv_budget_bytes)
        self.max_support = max_support
        self.min_confidence = min_confidence
        self.vocab_limit = vocab_limit
        self._sessions: dict[str, _Session] = {}

    def sessions(self) -> int:
        return len(self._sessions)

    @property
    def context_tokens(self) -> int:
        """Positions the draft model serves (its ``max_position_embeddings``)."""
        return int(self.model.config.max_position_embeddings)

    def kv_stats(self) -> KVStats:
        return self.kv.stats()

    def release(self, session_id: str) -> bool:
        self.kv.release(session_id)
        return self._sessions.pop(session_id, None) is not None

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftOutcome]:
        outcomes: list[DraftOutcome | None] = [None] * len(inputs)
        active: list[_Active] = []
        for i, x in enumerate(inputs):
            feed = self._sync(x)
            if feed is None:
                outcomes[i] = DraftOutcome.needs_history()
            elif x.k == 0:
                outcomes[i] = DraftOutcome(Proposal(tokens=[]))
            else:
                active.append(_Active(i, x.session_id, x.k, x.params, x.round_index, feed))
        if active:
            self._reserve(active)
            self._draft(active)
        for a in active:
            outcomes[a.index] = DraftOutcome(self._proposal(a))
        assert all(o is not None for o in outcomes)
        return outcomes  # type: ignore[return-value]

    # -- bookkeeping -------------------------------------------------------------

    def _sync(self, x: DraftInput) -> list[int] | None:
        """Bring the session up to date; returns the tokens to feed, or None if stale."""
        s = self._sessions.get(x.session_id)
        if s is not None and x.session_id not in self.kv:
            s = None  # evicted since the last call
            self._sessions.pop(x.session_id, None)
        if s is None:
            if x.start > 0:
                return None
            s = self._sessions[x.session_id] = _Session()
        if x.start > s.committed:
            return None
        # Committed history = tokens[:start] + new_tokens; keep what agrees with it.
        new = list(x.new_tokens)
        same = 0
        held = s.tokens[x.start :]
        while same < min(len(held), len(new)) and held[same] == new[same]:
            same += 1
        s.tokens = s.tokens[: x.start] + new
        s.committed = len(s.tokens)
        s.in_kv = min(s.in_kv, x.start + same)
        if s.in_kv == len(s.tokens):
            s.in_kv -= 1  # the next draft needs the last token's logits
        if x.session_id in self.kv:
            self.kv.truncate(x.session_id, s.in_kv)
        return s.tokens[s.in_kv :]

    def _reserve(self, active: list[_Active]) -> None:
        needs = {a.sid: len(a.feed) + a.k - 1 for a in active}
        for victim in self.kv.reserve(needs):
            self._sessions.pop(victim, None)

    # -- drafting ----------------------------------------------------------------

    @torch.inference_mode()
    def _draft(self, active: list[_Active]) -> None:
        running = list(active)
        while running:
            with ops.bfloat16_products(self.bfloat16_prefill):  # only a prefill's many rows
                logits = self.model([SeqInput(a.sid, a.feed) for a in running], self.kv)
            if self.vocab_limit is not None:
                logits = logits[:, : self.vocab_limit]
            for a in running:
                s = self._sessions[a.sid]
                s.in_kv += len(a.feed)
            # Read back once per step what every row needs, not a value per row.
            greedy: list[int] = []
            if any(a.params.greedy for a in running):
                greedy = logits.argmax(dim=-1).tolist()
            top: list[float] = []
            if self.min_confidence > 0:
                top = torch.softmax(logits, dim=-1).amax(dim=-1).tolist()
            still = []
            for row, a in enumerate(running):
                if top and top[row] < self.min_confidence:
                    continue
                token = greedy[row] if a.params.greedy else self._sample(a, logits[row])
                a.drafts.append(token)
                s = self._sessions[a.sid]
                s.tokens.append(token)
                if len(a.drafts) < a.k:
                    a.feed = [token]
                    still.append(a)
            running = still

    def _sample(self, a: _Active, logits: torch.Tensor) -> int:  # [vocab]
        """The draft token of a sampled session (coupled or the rejection rule's draw)."""
        s = self._sessions[a.sid]
        position = len(s.tokens)  # absolute position of the token being drafted
        probs = probabilities(logits.unsqueeze(0), a.params)[0]  # [vocab]
        m = min(self.max_support, probs.shape[0])
        vals, ids = torch.topk(probs, m)
        vals = vals / vals.sum()
        if a.params.coupled:
            seeds = [a.params.seed]
            return int(coupling.choose_among(vals[None], ids[None], seeds, [position])[0])
        u = uniform(a.params.seed, a.round_index, position, Stream.DRAFT)
        cdf = torch.cumsum(vals.double(), 0)
        pick = min(int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True)), m - 1)
        while vals[pick] == 0:  # never emit a token outside the support
            pick -= 1
        a.q_ids.append(ids)
        a.q_probs.append(vals.float())
        return int(ids[pick])

    def _proposal(self, a: _Active) -> Proposal:
        if a.params.greedy or a.params.coupled or not a.drafts:
            return Proposal(tokens=a.drafts)
        return Proposal(
            tokens=a.drafts,
            q_ids=torch.stack(a.q_ids),  # [k, m]
            q_probs=torch.stack(a.q_probs),  # [k, m]
        )
