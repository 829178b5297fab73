"""A session this orchestrator is decoding now: engine state, its stored record, its outbox.

The round runner owns every :class:`LiveSession` while it decodes: it commits
rounds to the record, puts the committed tokens in the outbox, and at the end
one :class:`Ended`. The request handler reads the outbox.

A session's lifecycle here is one :class:`Phase`: ``WAITING`` between rounds,
``IN_ROUND`` while a lane runs a round with it, ``ENDED`` once its :class:`Ended`
is in the outbox (for good). Three facts are independent of it and stay flags:
``cancel_requested`` (the client asked; the runner acts at the next round
boundary), ``draft_warming`` (its draft replica is prefilling it beside the
rounds, in any phase) and ``gone`` (its record was deleted or taken over: never
write it again, whatever the phase).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass

from opentelemetry import context as otel_context

from specserve.engine.decode_state import DecodeState, FinishReason
from specserve.engine.logprobs import TokenLogprob
from specserve.orchestrator.store import records
from specserve.orchestrator.types import Usage
from specserve.v1 import session_pb2


@dataclass(frozen=True)
class Ended:
    """The last outbox item: why decoding stopped, or the error the client gets."""

    reason: FinishReason | None
    error: BaseException | None = None


Outbox = asyncio.Queue[list[int] | Ended]


class Phase(enum.Enum):
    """Where a session is in its turn; ``ENDED`` is final."""

    WAITING = "waiting"  # placed on a lane, between rounds
    IN_ROUND = "in_round"  # a lane is running a round with it now
    ENDED = "ended"  # its Ended is in the outbox: no more rounds


class LiveSession:
    """One session's turn in flight."""

    def __init__(
        self,
        record: session_pb2.SessionRecord,
        state: DecodeState,
        *,
        prompt_tokens: int,
        base_usage: Usage,
        pre_turn: session_pb2.SessionRecord | None,
        deadline: float | None,
        trace_context: otel_context.Context | None = None,
        top_logprobs: int | None = None,
    ) -> None:
        self.sid = record.session_id
        self.record = record  # the last version written (record.version is the stored one)
        self.state = state
        self.prompt_tokens = prompt_tokens  # of this turn
        self.base_usage = base_usage  # cumulative usage before this turn
        self.pre_turn = pre_turn  # the record before this turn; None for a new session
        self.deadline = deadline  # time.monotonic() the client stops waiting at
        self.keep = record.keep
        self.outbox: Outbox = asyncio.Queue()
        self.cancel_requested = False
        self.rounds_committed = 0  # rounds of this turn now in the store
        self.committing = False  # a round's commit is in flight (its tokens not yet out)
        self.phase = Phase.WAITING
        self.draft_warming = False  # its draft replica is prefilling it beside the rounds
        self.gone = False  # the record was deleted or taken over: never write it again
        # > 0 in a round that sends only this many of the tokens its target lacks (a
        # prefill chunk: the session drafts and emits nothing in it)
        self.prefill_chunk = 0
        self.prefill_tail = False  # this round sends the last part of a chunked prompt
        # How far KV snapshots reach (--kv-snapshots); goes into the next record written.
        self.kv_snapshot: session_pb2.KvSnapshot | None = None
        self.started_ns = time.perf_counter_ns()
        # The request's tracing context: its round spans are children of the request span.
        self.trace_context = trace_context
        # Alternatives per token the client asked for (None: no log-probabilities), and
        # the TokenLogprob of each completion token committed so far.
        self.top_logprobs = top_logprobs
        self.logprobs: list[TokenLogprob] = []

    @property
    def done(self) -> bool:
        """The session ended (:meth:`end`); nothing is decoded or written for it now."""
        return self.phase is Phase.ENDED

    def enter_round(self) -> None:
        assert self.phase is Phase.WAITING, f"a {self.phase.value} session cannot start a round"
        self.phase = Phase.IN_ROUND

    def leave_round(self) -> None:
        """The round is over: back to waiting, unless it ended in it."""
        if self.phase is Phase.IN_ROUND:
            self.phase = Phase.WAITING

    @property
    def is_new(self) -> bool:
        return self.pre_turn is None

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def turn_usage(self) -> Usage:
        return records.turn_usage(self.state, self.prompt_tokens)

    def deliver(self, tokens: list[int]) -> None:
        if tokens:
            self.outbox.put_nowait(tokens)

    def end(self, reason: FinishReason | None, error: BaseException | None = None) -> None:
        self.phase = Phase.ENDED
        self.outbox.put_nowait(Ended(reason, error))
