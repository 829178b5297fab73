"""Which sessions share a round, on which replicas, with how many drafts: a pure state machine.

No grpc, no redis, no asyncio: the round runner asks, the scheduler answers.

**Lanes.** A lane is a target endpoint: every session placed on a target lives in
its lane, one round of a lane is one batched ``Verify`` on that target (and one
``Propose`` per draft replica its sessions use), and a runner drives each lane in
its own loop. One lane per target: two, proposing for one half while the target
verifies the other, cost batching and did not pay (plain decoding 1.45x faster with
one lane on shared cores, ``bench/results/concurrency_one_lane.md``; at emulated
accelerator round times plain 409 against 262 tok/s at 8 sessions, speculation
alike; docs/benchmarks.md).

**Continuous batching.** Sessions join and leave at round boundaries:
:meth:`Scheduler.join` parks a session as pending, :meth:`Scheduler.begin_round`
admits the pending ones and returns the batch (at most ``max_batch``, rotating
so every session gets its turn), :meth:`Scheduler.end_round` drops the finished.
**Token budget.** A round computes at most ``max_prefill_tokens`` rows on its target
(as vLLM's ``max_num_batched_tokens``): the tokens each session sends that the target
has not seen, verify rows and prefill alike, and its prompts carry at most what the
runner measured a round can take at their position without growing much past its
usual length (:mod:`~specserve.orchestrator.fleet.prefill_budget`). Decoding sessions
always go and are charged first; prompts then take what is left in line order, and
the first prompt that does not fit whole is sent in part, a *chunk* (at least one
token, so a prompt always progresses), and goes first again next round. A long
prompt is thus prefilled over consecutive rounds while the decoding sessions keep
theirs.

**Affinity.** A session prefers the target and draft replicas named in its
record (they hold a warm KV cache up to some position); otherwise it goes to
the least-loaded usable replica.

**k** is not chosen here: the planner (:mod:`specserve.policy`)
plans each round's k per session from the target's load (:meth:`Scheduler.target_load`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from specserve.engine.errors import EngineError

# A session this many tokens (or fewer) behind its target is decoding, not prefilling:
# a round commits at most k + 1 tokens, and k stays well under this.
DECODING_TOKENS = 32

LaneKey = str  # a lane is its target's endpoint


class NoReplica(EngineError):
    """No usable replica of a role is left (all are down or none is configured)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 64  # sessions per Verify call
    # Rows a round computes on its target (verify rows and prefill chunks): the most
    # the measured budget may be, and the budget until a round has been measured.
    max_prefill_tokens: int = 512
    admission_window_s: float = 0.01  # an idle lane waits this long for company

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if not 0 <= self.admission_window_s <= 1:
            raise ValueError(f"admission_window_s must be in 0..1 s, got {self.admission_window_s}")


@dataclass
class Placement:
    """Where a session runs now."""

    target: str
    draft: str | None  # None = no draft replica usable: decode at k = 0

    @property
    def lane(self) -> LaneKey:
        return self.target


@dataclass
class RoundBatch:
    """A round's sessions, in line order, and the prompts it prefills only in part."""

    ids: list[str]
    # session -> how many of its unseen tokens this round sends (fewer than it lacks):
    # it emits nothing this round and goes on prefilling in the next
    chunks: dict[str, int] = field(default_factory=dict)
    # prompts whose last part this round sends after chunks in earlier rounds
    tails: set[str] = field(default_factory=set)


@dataclass
class _Lane:
    pending: list[str] = field(default_factory=list)
    running: collections.deque[str] = field(default_factory=collections.deque)
    # prompts sent in part in an earlier round: their tail is a prompt's too, however short
    prefilling: set[str] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.pending) + len(self.running)


class Scheduler:
    """Placement and lanes for every session this orchestrator runs."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.targets: list[str] = []  # usable target endpoints
        self.drafts: list[str] = []  # usable draft endpoints
        self._placement: dict[str, Placement] = {}
        self._lanes: dict[LaneKey, _Lane] = {}

    # -- replicas ----------------------------------------------------------------------

    def set_usable(self, targets: Sequence[str], drafts: Sequence[str]) -> None:
        """The replicas new placements may use (sessions already placed stay put)."""
        self.targets = list(targets)
        self.drafts = list(drafts)

    def target_load(self, target: str) -> int:
        """Sessions placed on ``target`` (its Verify batch if they all run together)."""
        lane = self._lanes.get(target)
        return 0 if lane is None else len(lane)

    def draft_load(self, draft: str) -> int:
        return sum(1 for p in self._placement.values() if p.draft == draft)

    # -- placement ---------------------------------------------------------------------

    def place(
        self,
        session_id: str,
        *,
        prefer_target: str | None = None,
        prefer_draft: str | None = None,
        avoid_targets: Iterable[str] = (),
    ) -> Placement:
        """Choose replicas for a session (not yet joined)."""
        avoid = set(avoid_targets)
        targets = [t for t in self.targets if t not in avoid]
        if not targets:
            raise NoReplica("no target replica is reachable; retry later")
        if prefer_target in targets:
            target = prefer_target
        else:
            target = min(targets, key=lambda t: (self.target_load(t), targets.index(t)))
        return Placement(target, self.pick_draft(prefer_draft))

    def pick_draft(self, prefer: str | None = None, avoid: Iterable[str] = ()) -> str | None:
        """The preferred draft replica if usable, else the least loaded, else None."""
        skip = set(avoid)
        drafts = [d for d in self.drafts if d not in skip]
        if not drafts:
            return None
        if prefer in drafts:
            return prefer
        return min(drafts, key=lambda d: (self.draft_load(d), drafts.index(d)))

    def join(self, session_id: str, placement: Placement) -> LaneKey:
        """Park a session in its lane; it runs from the lane's next round on."""
        assert session_id not in self._placement, f"{session_id} joined twice"
        self._placement[session_id] = placement
        self._lanes.setdefault(placement.lane, _Lane()).pending.append(session_id)
        return placement.lane

    def placement(self, session_id: str) -> Placement | None:
        return self._placement.get(session_id)

    def set_draft(self, session_id: str, draft: str | None) -> None:
        self._placement[session_id].draft = draft

    def move(self, session_id: str, placement: Placement) -> LaneKey:
        """Move a session to another lane (target failover); it runs there from the next round."""
        self.leave(session_id)
        return self.join(session_id, placement)

    def leave(self, session_id: str) -> None:
        """Forget a session (finished, cancelled, failed). Unknown ids are ignored."""
        placement = self._placement.pop(session_id, None)
        if placement is None:
            return
        lane = self._lanes[placement.lane]
        lane.prefilling.discard(session_id)
        if session_id in lane.pending:
            lane.pending.remove(session_id)
        else:
            lane.running.remove(session_id)
        if not lane:
            del self._lanes[placement.lane]

    # -- rounds ------------------------------------------------------------------------

    def begin_round(
        self,
        lane: LaneKey,
        behind: Callable[[str], int] | None = None,
        prefill: Callable[[str], int] | None = None,
    ) -> RoundBatch:
        """Admit the lane's pending sessions and return this round's batch (may be empty).

        ``behind(sid)`` is how many tokens of the session's history its target has not
        seen; ``prefill(sid)`` the most prompt tokens the round may carry, measured at
        that prompt's position (default: no more than the rows; 0: none this round, the
        prompt waits unless the round would be empty). The round sends at
        most ``max_prefill_tokens`` rows in all. Decoding sessions (a round's worth
        behind, :data:`DECODING_TOKENS`) always go and are charged to the rows first;
        prompts share what is left of both in line order, the first that does not fit
        whole goes as a chunk (at least one token), the rest wait. Without ``behind``
        no budget applies.
        """
        state = self._lanes.get(lane)
        if state is None:
            return RoundBatch([])
        state.running.extend(state.pending)
        state.pending.clear()
        n = min(len(state.running), self.config.max_batch)
        head = [state.running.popleft() for _ in range(n)]
        cost = {sid: behind(sid) if behind is not None else 0 for sid in head}
        # A prompt's tail after its chunks is charged as a prompt, not as decoding rows.
        prompt = {
            sid: cost[sid] > DECODING_TOKENS or (sid in state.prefilling and cost[sid] > 0)
            for sid in head
        }
        batch = [sid for sid in head if not prompt[sid]]
        rows_left = self.config.max_prefill_tokens - sum(cost[sid] for sid in batch)
        carried = 0  # prompt tokens given out so far
        chunks: dict[str, int] = {}
        waiting: list[str] = []
        for sid in head:
            if not prompt[sid]:
                continue
            allowed = None if prefill is None else prefill(sid)
            if allowed is not None and allowed <= 0 and batch:
                waiting.append(sid)  # a round kept usual (re-measured); never an empty one
                continue
            left = rows_left if allowed is None else min(rows_left, allowed - carried)
            if cost[sid] <= left:
                batch.append(sid)
                rows_left -= cost[sid]
                carried += cost[sid]
            elif not chunks:  # the first that does not fit goes in part
                chunks[sid] = max(1, left)
                batch.append(sid)
                rows_left = 0
            else:
                waiting.append(sid)
        chosen = set(batch)
        batch = [sid for sid in head if sid in chosen]  # in line order
        # A chunked prompt goes on first next round, then whoever waited, then the rest.
        state.running.extendleft(reversed([*chunks, *waiting]))
        state.running.extend(sid for sid in batch if sid not in chunks)
        tails = {sid for sid in batch if sid in state.prefilling and sid not in chunks}
        state.prefilling = (state.prefilling & set(waiting)) | set(chunks)
        return RoundBatch(batch, chunks, tails)

    def end_round(self, finished: Iterable[str]) -> None:
        """Drop sessions that finished in the round."""
        for sid in finished:
            self.leave(sid)

    def lanes(self) -> list[LaneKey]:
        return list(self._lanes)

    def sessions(self) -> list[str]:
        return list(self._placement)
