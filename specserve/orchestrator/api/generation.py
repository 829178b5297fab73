"""The orchestrator's domain API: generate, cancel, inspect and close sessions.

:class:`Orchestrator` turns a request into a session turn — written to the store
before the first round, so a kept session and its owner are visible to every
replica — hands it to the round runner, and turns the runner's committed tokens
into text chunks. Every check that can fail on the request happens before
anything is written; a turn that fails before its first round commits is rolled
back (see :mod:`specserve.orchestrator.round.runner`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

from opentelemetry import context as otel_context
from opentelemetry import trace

from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.errors import EngineError, InvalidArgument, NotFound
from specserve.orchestrator.api import admission
from specserve.orchestrator.api.admission import AdmissionConfig, TargetLimits
from specserve.orchestrator.api.request_span import (
    fail_request_span,
    finish_request_span,
    start_request_span,
)
from specserve.orchestrator.api.request_stats import RequestStats
from specserve.orchestrator.api.text import TextStream, Tokenization
from specserve.orchestrator.errors import SessionBusy, SessionCancelled, VersionConflict
from specserve.orchestrator.round.runner import RoundRunner
from specserve.orchestrator.session import Ended, LiveSession
from specserve.orchestrator.store import records
from specserve.orchestrator.store.session_store import SessionStore, cancelled_message
from specserve.orchestrator.types import (
    MAX_NEW_TOKENS,
    Chunk,
    GenerateParams,
    SessionState,
    SessionSummary,
)
from specserve.v1 import session_pb2

SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def check_session_id(session_id: str) -> None:
    if not SESSION_ID.fullmatch(session_id):
        raise InvalidArgument(
            f"session_id {session_id[:40]!r} is not valid: use 1 to 128 letters, digits, "
            "'.', '_', ':' or '-'"
        )


class Orchestrator:
    """Sessions over the store and the round runner."""

    def __init__(
        self,
        store: SessionStore,
        runner: RoundRunner,
        text: Callable[[], Tokenization],
        *,
        model_name: str = "specserve",
        limits: AdmissionConfig | None = None,
    ) -> None:
        self.store = store
        self.runner = runner
        self.text = text  # the tokenizer may still be loading: ask each time
        self.model_name = model_name  # what traces call the model (gen_ai.request.model)
        self.stats = RequestStats()
        self.admission = limits or AdmissionConfig()
        self.target_limits = TargetLimits(runner.targets)

    async def generate(self, params: GenerateParams) -> AsyncIterator[Chunk]:
        """Run one turn; yields chunks as rounds commit, the last one with the finish."""
        t0 = time.perf_counter_ns()
        span = start_request_span(params, self.model_name)
        reason = "error"
        usage = None
        try:
            # aclosing: a client that leaves closes the turn's generator at once (its
            # finally cancels the session), not whenever it is collected.
            async with contextlib.aclosing(self._generate(params, span, t0)) as chunks:
                async for chunk in chunks:
                    if chunk.finish_reason is not None:
                        reason, usage = str(chunk.finish_reason), chunk.usage
                        finish_request_span(span, chunk)
                    yield chunk
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError | GeneratorExit):  # the client left
                reason = "cancelled"
            fail_request_span(span, e)
            raise
        finally:
            self.stats.ended(reason, (time.perf_counter_ns() - t0) / 1e9, usage)
            span.end()

    async def _generate(
        self, params: GenerateParams, span: trace.Span, t0: int
    ) -> AsyncIterator[Chunk]:
        if not 1 <= params.max_new_tokens <= MAX_NEW_TOKENS:
            raise InvalidArgument(
                f"max_new_tokens must be in 1..{MAX_NEW_TOKENS}, got {params.max_new_tokens}"
            )
        admission.check_request(params, self.admission)  # sizes first: before tokenizing
        text = self.text()
        prompt = await admission.encode(text, params.prompt, continuing=bool(params.session_id))
        if not params.session_id:  # a continued session is checked once its history is read
            admission.check_tokens(0, len(prompt), self.admission, await self.target_limits.get())
        eos_ids = frozenset() if params.ignore_eos else text.eos_ids
        stop = StopCriteria(params.max_new_tokens, eos_ids, params.stop)
        # Shielded: a client that leaves while the record is being written must not
        # leave an ACTIVE record without a runner; the session then ends at its first
        # round boundary instead, and the ledger cleans up. The task starts in the
        # request span's context, so the store calls and rounds are its children.
        with trace.use_span(span, end_on_exit=False):
            opening = asyncio.ensure_future(self._start(params, prompt, stop, text))
        try:
            live = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(self._cancel_opened)
            raise
        stream = TextStream(text, params.stop, skip_special_tokens=params.skip_special_tokens)
        seed = live.state.params.seed & ((1 << 64) - 1)
        delivered = 0
        first_ns = last_ns = 0
        try:
            while True:
                item = await live.outbox.get()
                if isinstance(item, Ended):
                    if item.error is not None:
                        raise item.error
                    done_ns = time.perf_counter_ns()
                    tail = stream.finish(live.state.completion, live.state.text_end)
                    yield Chunk(
                        live.sid,
                        tail,
                        finish_reason=item.reason,
                        usage=live.turn_usage(),
                        time_to_first_token_ns=(first_ns or done_ns) - t0,
                        duration_ns=done_ns - t0,
                        seed=seed,
                    )
                    return
                now = time.perf_counter_ns()
                if first_ns:
                    self.stats.delivered((now - last_ns) / 1e9, len(item))
                else:
                    first_ns = now
                    self.stats.first_token((now - t0) / 1e9)
                last_ns = now
                logprobs = tuple(live.logprobs[delivered : delivered + len(item)])
                delivered += len(item)
                delta = stream.push(item)
                yield Chunk(live.sid, delta, tuple(item), seed=seed, logprobs=logprobs)
        finally:
            if not live.done:  # the client went away: stop at the next round boundary
                self.runner.cancel(live.sid)

    async def _start(
        self, params: GenerateParams, prompt: list[int], stop: StopCriteria, text: Tokenization
    ) -> LiveSession:
        live = await self._open(params, prompt, stop, text)
        try:
            self.runner.submit(live)
        except EngineError as e:  # no target replica: undo the turn's record
            await self.runner.abandon(live, e)
            raise
        return live

    def _cancel_opened(self, opening: asyncio.Future[LiveSession]) -> None:
        if not opening.cancelled() and opening.exception() is None:
            self.runner.cancel(opening.result().sid)

    async def _open(
        self, params: GenerateParams, prompt: list[int], stop: StopCriteria, text: Tokenization
    ) -> LiveSession:
        """Write the turn's record (new session, or the next turn of a kept one)."""
        pre_turn = None
        if params.session_id:
            pre_turn, cancelled = await self._owned(params.session_id, params.owner)
            if pre_turn is None:
                raise NotFound(
                    f"session {params.session_id!r} does not exist: it was closed, expired, or "
                    "not kept (set keep_session to continue a session later)"
                )
            leased = await self.store.leased(params.session_id)
            if cancelled:  # ended here if its orchestrator died before it saw the cancel
                if self._orphaned(pre_turn, leased, params.session_id in self.runner.sessions):
                    await self._cancel_orphan(pre_turn)
                raise SessionCancelled(cancelled_message(params.session_id))
            if records.is_active(pre_turn, leased=leased):
                raise SessionBusy(
                    f"session {params.session_id!r} is generating; wait for it to finish or "
                    "call CancelSession"
                )
            seed = params.seed if params.seed is not None else pre_turn.sampling.seed
            base = pre_turn
        else:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            base = records.new_record(uuid.uuid4().hex, params.owner)
        history = len(base.tokens)
        limit = await self.target_limits.get()
        admission.check_tokens(history, len(prompt), self.admission, limit)
        new_max = admission.max_new_tokens(params.max_new_tokens, history, len(prompt), limit)
        if new_max != params.max_new_tokens:  # the session must stay within the context
            params = dataclasses.replace(params, max_new_tokens=new_max)
            stop = dataclasses.replace(stop, max_new_tokens=new_max)
        sampling = dataclasses.replace(params.sampling, seed=seed)
        turn = records.start_turn(base, prompt, params, sampling)
        state = DecodeState(
            turn.session_id,
            list(turn.tokens),
            sampling,
            stop,
            self.runner.planner.session_policy(params.k),
            drafter=params.drafter,
            decode=text.decoder(skip_special_tokens=params.skip_special_tokens),
            round_index=turn.round_index,
        )
        if pre_turn is None:
            written = await self.store.create(turn)
        else:  # final: also clears a cancel flag left from an earlier turn
            written, _ = await self.store.commit(turn, final=True)
        return LiveSession(
            written,
            state,
            prompt_tokens=len(prompt),
            base_usage=records.usage_of(base),
            pre_turn=pre_turn,
            deadline=params.deadline,
            trace_context=otel_context.get_current(),
            top_logprobs=params.logprobs,
        )

    def token_text(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """One token id decoded alone (the text of a logprobs entry; a special token's is
        empty unless the request keeps special tokens, as in its text)."""
        return self.text().decode([token_id], skip_special_tokens=skip_special_tokens)

    async def _owned(
        self, session_id: str, owner: bytes
    ) -> tuple[session_pb2.SessionRecord | None, bool]:
        """The session's record and whether it was cancelled (CancelSession); None when it
        does not exist *or belongs to another API key*: a caller cannot tell another
        key's session from none at all."""
        check_session_id(session_id)
        record, cancelled = await self.store.load(session_id)
        if record is None or not hmac.compare_digest(record.owner, owner):
            return None, False
        return record, cancelled

    @staticmethod
    def _orphaned(record: session_pb2.SessionRecord, leased: bool, local: bool) -> bool:
        """ACTIVE with no lease and not run here (``local``): its orchestrator died mid-turn."""
        active = record.state == records.STATES[SessionState.ACTIVE]
        return active and not leased and not local

    async def cancel(self, session_id: str, owner: bytes = b"") -> bool:
        """Stop a session's generation, on whichever replica runs it; False if none runs.

        A generating (ACTIVE) session is first marked cancelled in the store, atomically
        and for good, whether or not this orchestrator owns it and whether or not its
        lease is live: its owner, if alive, stops at its next commit and ends it
        CANCELLED; nothing (a dying owner's last write, a takeover, a client continuing
        it) can end it otherwise; one whose owner is dead is ended CANCELLED here.
        """
        record, _ = await self._owned(session_id, owner)
        if record is None:
            raise NotFound(f"session {session_id!r} does not exist")
        local = self.runner.cancel(session_id)
        if record.state != records.STATES[SessionState.ACTIVE]:
            return local
        await self.store.request_cancel(session_id)
        leased = await self.store.leased(session_id)
        if self._orphaned(record, leased, local):
            # Its orchestrator died mid-turn (the lease ran out): nothing will see the
            # cancel flag, so end the turn here.
            return await self._cancel_orphan(record)
        return leased or local

    async def _cancel_orphan(self, record: session_pb2.SessionRecord) -> bool:
        """Mark a session whose orchestrator died CANCELLED (if it is kept) or delete it;
        False if someone else wrote it first (it was continued or ended meanwhile)."""
        try:
            if record.keep:
                await self.store.commit(
                    records.ended(record, SessionState.CANCELLED, warm=False), final=True
                )
            else:
                await self.store.delete(record.session_id, version=record.version)
        except (VersionConflict, NotFound):
            return False
        await self.runner.release_owners(record)
        return True

    async def get(self, session_id: str, owner: bytes = b"") -> SessionSummary:
        """What GetSession reports: CANCELLED for a session cancelled with CancelSession
        even before anything wrote its final record (its orchestrator died)."""
        record, cancelled = await self._owned(session_id, owner)
        if record is None:
            raise NotFound(f"session {session_id!r} does not exist")
        leased = await self.store.leased(session_id)
        return records.summary(record, leased=leased, cancelled=cancelled)

    async def close_session(self, session_id: str, owner: bytes = b"") -> bool:
        """Delete a session and free its caches; a generation in flight stops."""
        record, _ = await self._owned(session_id, owner)
        if record is None:
            raise NotFound(f"session {session_id!r} does not exist")
        self.runner.cancel(session_id)
        deleted = await self.store.delete(session_id)
        await self.runner.release_owners(record)
        return deleted
