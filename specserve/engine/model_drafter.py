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

With ``draft_ahead > 0`` the drafter also drafts ahead between calls
(:meth:`ModelDrafter.idle_step`, :mod:`specserve.engine.draft_ahead`) for the
sessions of a call that drafted for at most ``AHEAD_MAX_SESSIONS``: the tokens it
holds past a session's drafts are its guess of the bonus and the drafts after it,
which the next call uses when the guess was right.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from specserve.engine import ops
from specserve.engine.draft_ahead import (
    AHEAD_MAX_SESSIONS,
    MAX_DRAFT_AHEAD,
    Ahead,
    AheadCounts,
    Predrafted,
)
from specserve.engine.draft_sampling import DrawRow, draw_rows
from specserve.engine.draft_vocab import kept_ids
from specserve.engine.drafter import DrafterKind, DraftInput, DraftOutcome
from specserve.engine.kv_cache import KVStats
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.rejection import Proposal
from specserve.engine.sampling import SamplingParams
from specserve.engine.step_runner import StepOptions, StepRow, StepRunner


@dataclass
class _Session:
    tokens: list[int] = field(default_factory=list)  # committed tokens, drafts, ahead tokens
    committed: int = 0  # how many of ``tokens`` are committed
    in_kv: int = 0  # how many of ``tokens`` have K/V in the pool
    ahead: Ahead | None = None  # drafting ahead past the last drafts (tokens[ahead.start:])


@dataclass
class _Active:
    index: int  # position in the request
    sid: str
    k: int
    params: SamplingParams
    round_index: int
    feed: list[int]  # tokens to run in the next forward
    floor: float = 0.0  # the session's depth floor (DraftInput.min_confidence)
    sure: float = 1.0  # the product of this round's draft top probabilities so far
    drafts: list[int] = field(default_factory=list)  # ahead drafts first, if it took any
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
        draft_ahead: int = 0,
        steps: StepOptions | None = None,
    ) -> None:
        """``draft_ahead``: ahead tokens (the bonus guess included) an idle step may draft
        per session past its last proposal; 0 = none. ``steps``: run greedy and coupled
        draft steps as static-shape steps (:mod:`specserve.engine.step_runner`; on CUDA
        captured as CUDA graphs here) with these options (``k_max`` and ``support`` are
        the drafter's own); None: every step on the eager forward."""
        if not 0 <= draft_ahead <= MAX_DRAFT_AHEAD:
            raise ValueError(f"draft_ahead must be in [0, {MAX_DRAFT_AHEAD}], got {draft_ahead}")
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
        self.draft_ahead = draft_ahead
        self.ahead_counts = AheadCounts()
        self.steps = None
        if steps is not None:  # one new token a session and step, coupled among max_support
            options = replace(steps, k_max=0, support=self.max_support, batch_invariant=False)
            vocab = self.vocab_limit or model.config.vocab_size
            self.steps = StepRunner.build_or_none(model, self.kv, options, vocab, "draft steps")
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
        drafting: list[_Active] = []  # sessions with k > 0
        active: list[_Active] = []  # those of them that need forwards
        for i, x in enumerate(inputs):
            synced = self._sync(x)
            if synced is None:
                outcomes[i] = DraftOutcome.needs_history()
                continue
            feed, pre = synced
            a = _Active(i, x.session_id, x.k, x.params, x.round_index, feed, x.min_confidence)
            if pre is not None:
                a.drafts, a.q_ids, a.q_probs = list(pre.tokens), list(pre.q_ids), list(pre.q_probs)
            if x.k == 0:
                outcomes[i] = DraftOutcome(Proposal(tokens=[]))
                continue
            drafting.append(a)
            if pre is not None and (pre.final or len(pre.tokens) == x.k):
                outcomes[i] = DraftOutcome(self._proposal(a))  # no forward: all ahead
            else:
                active.append(a)
        if active:
            self._reserve(active)
            self._draft(active)
        for a in active:
            outcomes[a.index] = DraftOutcome(self._proposal(a))
        if len(drafting) <= AHEAD_MAX_SESSIONS:
            for a in drafting:
                self._start_ahead(a)
        assert all(o is not None for o in outcomes)
        return outcomes  # type: ignore[return-value]

    # -- bookkeeping -------------------------------------------------------------

    def _sync(self, x: DraftInput) -> tuple[list[int], Predrafted | None] | None:
        """Bring the session up to date; returns the tokens to feed and the ahead drafts it
        takes (if any), or None if stale."""
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
        ahead, s.ahead = s.ahead, None
        pre = None
        if ahead is not None and same == len(new) and ahead.matches(x):
            pre = Predrafted.take(ahead, held[len(new) :], x.k)
            self.ahead_counts.hit(len(pre.tokens))
        s.tokens = s.tokens[: x.start] + new + (pre.tokens if pre is not None else [])
        s.committed = x.committed_len
        s.in_kv = min(s.in_kv, x.start + same + (len(pre.tokens) if pre is not None else 0))
        if s.in_kv == len(s.tokens):
            s.in_kv -= 1  # the next draft needs the last token's logits
        if x.session_id in self.kv:
            self.kv.truncate(x.session_id, s.in_kv)
        return s.tokens[s.in_kv :], pre

    def _reserve(self, active: list[_Active]) -> None:
        needs = {a.sid: len(a.feed) + a.k - len(a.drafts) - 1 for a in active}
        for victim in self.kv.reserve(needs):
            self._sessions.pop(victim, None)

    # -- drafting ----------------------------------------------------------------

    @torch.inference_mode()
    def _draft(self, active: list[_Active]) -> None:
        running = list(active)
        while running:
            rows = self._static_rows(running)
            top: list[float] = []
            if rows is not None and self.steps is not None:  # a static step (CUDA graphs)
                with ops.bfloat16_products(self.bfloat16_prefill):  # a catch-up's many rows
                    tokens = [t for _, t in self.steps.run_rows(rows)]
                for a in running:
                    self._sessions[a.sid].in_kv += len(a.feed)
                going = list(range(len(running)))
            else:
                tokens, going, top = self._eager_step(running)
            still = []
            for row, token in zip(going, tokens, strict=True):
                a = running[row]
                a.drafts.append(token)
                s = self._sessions[a.sid]
                s.tokens.append(token)
                if top:
                    a.sure *= top[row]
                if len(a.drafts) < a.k and a.sure >= a.floor:
                    a.feed = [token]
                    still.append(a)
            running = still

    def _eager_step(self, running: list[_Active]) -> tuple[list[int], list[int], list[float]]:
        """One draft step on the eager forward: the tokens drawn, the rows (of
        ``running``) that drew them, and each row's top probability where a floor needs it."""
        # Greedy rows need only a restricted head's kept ids' logits: their argmax and top
        # probability are the full rows' (every other logit is -inf).
        greedy_only = all(a.params.greedy for a in running)
        kept = kept_ids(self.model.head_ids, self.vocab_limit) if greedy_only else None
        with ops.bfloat16_products(self.bfloat16_prefill):  # only a prefill's many rows
            seqs = [SeqInput(a.sid, a.feed) for a in running]
            logits = self.model(seqs, self.kv, kept_only=kept is not None)
        if kept is not None:
            logits = logits if kept.columns is None else logits[:, kept.columns]
        elif self.vocab_limit is not None:
            logits = logits[:, : self.vocab_limit]
        for a in running:
            s = self._sessions[a.sid]
            s.in_kv += len(a.feed)
        # Read back once per step what every row needs, not a value per row.
        greedy: list[int] = []
        if any(a.params.greedy for a in running):
            best = logits.argmax(dim=-1)
            greedy = (best if kept is None else kept.ids[best]).tolist()
        # The replica's floor drops a draft below it and stops; a session's depth
        # floor stops drafting after the draft whose product falls below it.
        top: list[float] = []
        if self.min_confidence > 0 or any(a.floor > 0 for a in running):
            top = torch.softmax(logits, dim=-1).amax(dim=-1).tolist()
        floor = self.min_confidence
        going = [row for row in range(len(running)) if not top or top[row] >= floor]
        return self._sample([running[row] for row in going], logits, greedy, going), going, top

    def _static_rows(self, running: list[_Active]) -> list[StepRow] | None:
        """The step's rows where a static step serves it (greedy and coupled sessions, no
        confidence floor: a floor needs each row's top probability), else None."""
        if self.steps is None or self.min_confidence > 0 or any(a.floor > 0 for a in running):
            return None
        at = [(a, self.kv.length(a.sid), len(self._sessions[a.sid].tokens)) for a in running]
        rows = [StepRow(a.sid, start, a.feed, 0, a.params, pos) for a, start, pos in at]
        return rows if self.steps.takes_rows(rows) else None

    def _sample(
        self, active: list[_Active], logits: torch.Tensor, greedy: list[int], rows: list[int]
    ) -> list[int]:
        """The next draft token of each of ``active``, whose step row is ``rows[i]`` (its
        logits ``logits[rows[i]]``, its argmax ``greedy[rows[i]]``): sampled sessions'
        drawn together, each one's sparse q appended under the rejection rule."""
        tokens = [
            greedy[row] if a.params.greedy else -1 for a, row in zip(active, rows, strict=True)
        ]
        drawing = [i for i, a in enumerate(active) if not a.params.greedy]
        draws = [
            DrawRow(a.params, a.round_index, len(self._sessions[a.sid].tokens))
            for a in (active[i] for i in drawing)
        ]
        drawn, qs = draw_rows(draws, _rows(logits, [rows[i] for i in drawing]), self.max_support)
        for i, token, q in zip(drawing, drawn, qs, strict=True):
            tokens[i] = token
            if q is not None:
                active[i].q_ids.append(q[0])
                active[i].q_probs.append(q[1])
        return tokens

    # -- drafting ahead ------------------------------------------------------------

    def _start_ahead(self, a: _Active) -> None:
        """After a proposal: the session may draft ahead from past its drafts, if its
        last draft's logits are still to come (no draft was dropped below the replica's
        floor)."""
        s = self._sessions[a.sid]
        if self.draft_ahead and a.k > 0 and s.in_kv == len(s.tokens) - 1:
            s.ahead = Ahead(len(s.tokens), a.params, a.round_index + 1)

    def _wants_ahead(self, sid: str, s: _Session) -> bool:
        a = s.ahead
        return (
            a is not None
            and not a.stopped
            and len(s.tokens) - a.start < self.draft_ahead
            and len(s.tokens) < self.context_tokens
            and sid in self.kv
        )

    @torch.inference_mode()
    def idle_step(self) -> bool:
        """One forward of ahead drafting over every session with some left to draft;
        returns whether it ran one. Takes only free KV blocks: never evicts a session."""
        free = self.kv.alloc.free_blocks
        rows: list[tuple[str, _Session]] = []
        for sid, s in self._sessions.items():
            if not self._wants_ahead(sid, s):
                continue
            alloc = self.kv.alloc
            extra = alloc.blocks_needed(alloc.length(sid) + 1) - len(alloc.block_table(sid))
            if extra <= free:
                free -= extra
                rows.append((sid, s))
        if not rows:
            return False
        assert all(s.in_kv == len(s.tokens) - 1 for _, s in rows), "ahead needs the last logits"
        assert not self.kv.reserve({sid: 1 for sid, _ in rows}), "ahead drafting evicted"
        with ops.bfloat16_products(self.bfloat16_prefill):
            logits = self.model([SeqInput(sid, [s.tokens[-1]]) for sid, s in rows], self.kv)
        if self.vocab_limit is not None:
            logits = logits[:, : self.vocab_limit]
        argmax = logits.argmax(dim=-1).tolist()
        top: list[float] = []
        if self.min_confidence > 0:
            top = torch.softmax(logits, dim=-1).amax(dim=-1).tolist()
        going = []
        for row, (_, s) in enumerate(rows):
            s.in_kv += 1
            assert s.ahead is not None
            if top and top[row] < self.min_confidence:
                s.ahead.stopped = True  # drafting from this history stops here as well
            else:
                going.append(row)
        # The bonus guess is the target's likeliest token (coupled: its coupled choice);
        # a draft of the next round is drawn as it would be then.
        drawing: list[tuple[int, Ahead]] = []
        for row in going:
            ahead = rows[row][1].ahead
            if ahead is not None and _draws(rows[row][1]):
                drawing.append((row, ahead))
        draws = [DrawRow(a.params, a.round_index, len(rows[row][1].tokens)) for row, a in drawing]
        on = [row for row, _ in drawing]
        drawn, qs = draw_rows(draws, _rows(logits, on), self.max_support)
        tokens = list(argmax)
        for (row, ahead), token, q in zip(drawing, drawn, qs, strict=True):
            tokens[row] = token
            if q is not None:
                ahead.q_ids.append(q[0])
                ahead.q_probs.append(q[1])
        for row in going:
            rows[row][1].tokens.append(tokens[row])
        drafted = len(going)
        self.ahead_counts.drafted_step(drafted)
        return True

    def _proposal(self, a: _Active) -> Proposal:
        if a.params.greedy or a.params.coupled or not a.drafts:
            return Proposal(tokens=a.drafts)
        return Proposal(
            tokens=a.drafts,
            q_ids=torch.stack(a.q_ids),  # [k, m]
            q_probs=torch.stack(a.q_probs),  # [k, m]
        )


def _draws(s: _Session) -> bool:
    """Whether drafting ahead draws this session's next token rather than its argmax:
    the bonus guess of a coupled session, or any later draft of a sampled one."""
    ahead = s.ahead
    assert ahead is not None
    if len(s.tokens) == ahead.start:
        return ahead.params.coupled
    return not ahead.params.greedy


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``, without a copy when that is every row in order."""
    return logits if rows == list(range(logits.shape[0])) else logits[rows]
