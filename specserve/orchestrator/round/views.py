"""What the planner and the scheduler see of a live session: plain numbers, no I/O."""

from __future__ import annotations

from collections.abc import Iterable

from specserve.orchestrator.fleet.scheduler import DECODING_TOKENS
from specserve.orchestrator.session import LiveSession
from specserve.policy import Cache, SessionView


def session_view(s: LiveSession, warm_above_tokens: int) -> SessionView:
    """The session as the planner sees it (a model drafter more than
    ``warm_above_tokens`` behind its history is cold; n-gram drafters index any
    history cheaply)."""
    st = s.state
    cache = Cache.WARM
    if s.draft_warming:
        cache = Cache.WARMING
    elif st.drafter == "model" and draft_backlog([s]) > warm_above_tokens:
        cache = Cache.COLD
    return SessionView(
        sid=s.sid,
        drafter=str(st.drafter),
        requested_k=st.k_policy.fixed,
        tokens_left=st.stop.max_new_tokens - st.completion_len,
        alpha=st.k_policy.alpha,
        turn_drafted=st.stats.drafted,
        turn_accepted=st.stats.accepted,
        turn_rejections=st.stats.rejections,
        cache=cache,
        target_behind=target_backlog(s),
        draft_synced=st.drafter == "none" or st.last_drafted > 0,
    )


def target_backlog(s: LiveSession) -> int:
    """Tokens of a session's history its target has not seen (its prefill)."""
    return len(s.state.tokens) - s.state.target_start


def prefills(sessions: Iterable[LiveSession]) -> list[tuple[int, int]]:
    """The prompts a round sends its target, as (tokens the target holds, tokens sent):
    each prompt's chunk, or all it lacks (a session a round's worth behind,
    :data:`DECODING_TOKENS`, is decoding, unless that is a chunked prompt's tail)."""
    return [
        (s.state.target_start, s.prefill_chunk or b)
        for s in sessions
        if (b := target_backlog(s)) > DECODING_TOKENS or s.prefill_tail
    ]


def draft_backlog(sessions: Iterable[LiveSession]) -> int:
    """History tokens of these sessions their draft replica has not seen (a warm-up)."""
    return sum(len(s.state.tokens) - s.state.draft_start for s in sessions)
