"""Spans of one round of a batch: one per session in its own trace, the batch's work under one.

A round serves several sessions, each in the trace of its own request, but its
Propose, Verify and commit calls are made once for all of them. So:

* every session gets a round span (``specserve.prefill`` for the first round of
  a turn, ``specserve.round`` after), the child of its request span, with its
  ``spec.k``, ``spec.drafted`` and ``spec.accepted``;
* the batch's phases (``specserve.propose``, ``specserve.verify``,
  ``specserve.commit``, ``specserve.finish``) are children of the first
  recording session's round span — the batch's *leader* — and link to the other
  sessions' round spans. The gRPC and Redis spans of the phase nest below it.

With tracing off every span here is the API's no-op span, and nothing is set.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from specserve.orchestrator.round.calls import Plan, VerifyOutcome
from specserve.orchestrator.session import LiveSession
from specserve.telemetry import attributes as attr

tracer = trace.get_tracer(__name__)


class RoundSpans:
    """The round spans of one batch; end them with :meth:`end`."""

    def __init__(self, live: list[LiveSession], target: str) -> None:
        self.spans: dict[str, Span] = {}
        for s in live:
            first = s.rounds_committed == 0 and not s.committing
            span = tracer.start_span(
                attr.SPAN_PREFILL if first else attr.SPAN_ROUND, context=s.trace_context
            )
            if span.is_recording():
                span.set_attributes(
                    {
                        attr.SESSION_ID: s.sid,
                        attr.SPEC_ROUND_INDEX: s.state.round_index,
                        attr.TARGET: target,
                        attr.BATCH_SIZE: len(live),
                    }
                )
                if first:
                    new = len(s.state.tokens) - s.state.target_start
                    span.set_attribute(attr.PREFILL_TOKENS, new)
            self.spans[s.sid] = span
        recording = [span for span in self.spans.values() if span.is_recording()]
        leader = recording[0] if recording else next(iter(self.spans.values()))
        self._context = trace.set_span_in_context(leader)
        self._links = [trace.Link(span.get_span_context()) for span in recording[1:]]

    @contextmanager
    def phase(self, name: str) -> Iterator[Span]:
        """A batch-level span, current while the phase runs (its calls nest below it)."""
        with tracer.start_as_current_span(name, context=self._context, links=self._links) as span:
            yield span

    def detached_phase(self, name: str) -> Span:
        """A batch-level span the caller ends, for a phase that outlives the round (its
        commit, which runs while the next round proposes)."""
        return tracer.start_span(name, context=self._context, links=self._links)

    @staticmethod
    def proposed(span: Span, plans: dict[str, Plan], k_cap: int) -> None:
        """The propose phase's attributes: sessions with drafts, tokens drafted, the cap."""
        if span.is_recording():
            span.set_attributes(
                {
                    attr.BATCH_SIZE: sum(1 for p in plans.values() if p.draft is not None),
                    attr.SPEC_DRAFTED: sum(len(p.proposal.tokens) for p in plans.values()),
                    attr.SPEC_K_CAP: k_cap,
                }
            )

    @staticmethod
    def verified(
        span: Span, target: str, plans: dict[str, Plan], outcome: VerifyOutcome, replayed: int
    ) -> None:
        """The verify phase's attributes; ``replayed``: sessions moved to another target."""
        if span.is_recording():
            span.set_attributes(
                {
                    attr.TARGET: target,
                    attr.BATCH_SIZE: max(outcome.batch_sizes, default=0),
                    attr.SPEC_DRAFTED: sum(len(p.proposal.tokens) for p in plans.values()),
                    attr.SPEC_ACCEPTED: sum(v.accepted for v in outcome.verdicts.values()),
                    attr.REPLAYED: replayed,
                }
            )

    def asked(self, s: LiveSession, k: int) -> None:
        span = self.spans[s.sid]
        if span.is_recording():
            span.set_attribute(attr.SPEC_K, k)

    def verdict(self, s: LiveSession, drafted: int, accepted: int) -> None:
        span = self.spans[s.sid]
        if span.is_recording():
            span.set_attributes({attr.SPEC_DRAFTED: drafted, attr.SPEC_ACCEPTED: accepted})

    def fail(self, s: LiveSession, error: BaseException) -> None:
        span = self.spans[s.sid]
        if span.is_recording():
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, str(error)))

    def end(self, error: BaseException | None = None) -> None:
        for span in self.spans.values():
            if error is not None and span.is_recording():
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, str(error)))
            span.end()
