"""Session caches across calls: lost caches are rebuilt, strict calls fail, Release frees KV."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from bench.round_client import RoundClient, RpcTiming
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.tiny import tiny_from_spec
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy
from specserve.serving.launch import ServerProcess
from specserve.v1 import common_pb2, draft_pb2, target_pb2
from tests.services.conftest import COMMON, DRAFT, TARGET, Stubs, run, sid, start_all

PROMPTS = [[5, 9, 14, 3, 5, 9, 14, 3, 7], [100, 4, 4, 8, 100, 4, 4, 8, 1, 2]]
NEW_TOKENS = 30
NEEDS_HISTORY = common_pb2.SESSION_STATUS_NEEDS_HISTORY


def sessions() -> list[DecodeState]:
    return [
        DecodeState(sid(), p, SamplingParams(), StopCriteria(NEW_TOKENS), KPolicy(3))
        for p in PROMPTS
    ]


def target_only() -> list[list[int]]:
    engine = SpeculativeEngine(TargetVerifier(tiny_from_spec(TARGET), 8 << 20), {})
    plain = [
        DecodeState(
            sid(), p, SamplingParams(), StopCriteria(NEW_TOKENS), KPolicy(0), drafter="none"
        )
        for p in PROMPTS
    ]
    engine.run(plain)
    return [s.completion for s in plain]


@pytest.fixture(scope="module")
def own_pair() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A pair this module may restart and whose load it alone changes."""
    target = ServerProcess("target", ["--model", TARGET, *COMMON])
    draft = ServerProcess("draft", ["--model", DRAFT, *COMMON])
    try:
        start_all(target, draft)
        yield target, draft
    finally:
        target.stop()
        draft.stop()


def test_restarted_draft_server_asks_for_history_and_decoding_goes_on(
    own_pair: tuple[ServerProcess, ServerProcess],
) -> None:
    target, draft = own_pair
    states = sessions()
    calls: list[RpcTiming] = []

    async def rounds(n: int) -> None:
        async with Stubs(target, draft) as stubs:
            client = RoundClient(stubs.target, stubs.draft, on_rpc=calls.append)
            for _ in range(n):
                await client.round([s for s in states if not s.finished])

    run(rounds(2))
    assert all(s.draft_start > 0 for s in states)
    draft.stop()
    draft.start().wait_serving()  # a new process: every draft cache is gone

    async def raw() -> draft_pb2.ProposeResponse:
        async with Stubs(target, draft) as stubs:
            s = states[0]
            request = draft_pb2.ProposeRequest(
                sessions=[
                    draft_pb2.DraftSession(
                        session_id=s.session_id, start=s.draft_start, new_tokens=[1], k=3
                    )
                ]
            )
            return await stubs.draft.Propose(request)

    assert run(raw()).results[0].status == NEEDS_HISTORY
    calls.clear()

    async def finish() -> None:
        async with Stubs(target, draft) as stubs:
            await RoundClient(stubs.target, stubs.draft, on_rpc=calls.append).run(states)

    run(finish())
    # The first round after the restart proposed twice: once stale, once with the history.
    assert [c.method for c in calls[:3]] == ["Propose", "Propose", "Verify"]
    assert calls[1].sessions == len(states)
    assert [s.completion for s in states] == target_only()
    assert sum(s.stats.accepted for s in states) > 0


def test_target_that_lost_a_cache_gets_the_history(
    own_pair: tuple[ServerProcess, ServerProcess],
) -> None:
    states = sessions()
    calls: list[RpcTiming] = []

    async def go() -> None:
        async with Stubs(*own_pair) as stubs:
            client = RoundClient(stubs.target, stubs.draft, on_rpc=calls.append)
            await client.round(states)
            await stubs.target.Release(
                common_pb2.ReleaseRequest(session_ids=[states[1].session_id])
            )
            calls.clear()
            await client.run(states)

    run(go())
    assert [c.method for c in calls[:3]] == ["Propose", "Verify", "Verify"]
    assert calls[2].sessions == 1  # only the released session was resent
    assert [s.completion for s in states] == target_only()


def verify_request(session_id: str, start: int, tokens: list[int], strict: bool):
    return target_pb2.VerifyRequest(
        sessions=[target_pb2.VerifySession(session_id=session_id, start=start, new_tokens=tokens)],
        strict=strict,
    )


def test_strict_calls_fail_instead_of_asking_for_history(
    own_pair: tuple[ServerProcess, ServerProcess],
) -> None:
    known = sid()

    async def go() -> list[tuple[grpc.StatusCode, str]]:
        out = []
        async with Stubs(*own_pair) as stubs:
            await stubs.target.Verify(verify_request(known, 0, [1, 2, 3], strict=True))
            for request in (
                verify_request(sid("never-seen"), 5, [1], strict=True),  # not held at all
                verify_request(known, 9, [1], strict=True),  # held, but only 3 tokens
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stubs.target.Verify(request)
                out.append((e.value.code(), e.value.details()))
            lenient = await stubs.target.Verify(verify_request(known, 9, [1], strict=False))
            assert lenient.results[0].status == NEEDS_HISTORY
            propose = draft_pb2.ProposeRequest(
                sessions=[draft_pb2.DraftSession(session_id=sid(), start=4, new_tokens=[1], k=2)],
                strict=True,
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stubs.draft.Propose(propose)
            out.append((e.value.code(), e.value.details()))
            await stubs.target.Release(common_pb2.ReleaseRequest(session_ids=[known]))
        return out

    (unknown, behind, draft_unknown) = run(go())
    assert unknown[0] == grpc.StatusCode.NOT_FOUND and "holds no cache" in unknown[1]
    assert (
        behind[0] == grpc.StatusCode.FAILED_PRECONDITION and "fewer committed tokens" in behind[1]
    )
    assert draft_unknown[0] == grpc.StatusCode.NOT_FOUND and "draft replica" in draft_unknown[1]


def test_release_frees_kv(own_pair: tuple[ServerProcess, ServerProcess]) -> None:
    ids = [sid(), sid()]

    async def go() -> tuple[common_pb2.LoadReport, ...]:
        async with Stubs(*own_pair) as stubs:
            empty = common_pb2.GetLoadRequest()
            before = await stubs.target.GetLoad(empty)
            for i in ids:
                await stubs.target.Verify(verify_request(i, 0, list(range(1, 40)), strict=False))
                await stubs.draft.Propose(
                    draft_pb2.ProposeRequest(
                        sessions=[draft_pb2.DraftSession(session_id=i, new_tokens=[1, 2, 3], k=2)]
                    )
                )
            held_t, held_d = await stubs.target.GetLoad(empty), await stubs.draft.GetLoad(empty)
            release = common_pb2.ReleaseRequest(session_ids=[*ids, sid("unknown")])
            released = await stubs.target.Release(release)
            assert released.released == 2
            assert (await stubs.draft.Release(release)).released == 2
            after_t, after_d = await stubs.target.GetLoad(empty), await stubs.draft.GetLoad(empty)
            return before, held_t, held_d, after_t, after_d

    before, held_t, held_d, after_t, after_d = run(go())
    assert held_t.sessions == before.sessions + 2
    assert held_t.kv_bytes_used > before.kv_bytes_used
    assert (
        held_t.kv_bytes_used + held_t.kv_bytes_free == before.kv_bytes_used + before.kv_bytes_free
    )
    assert (after_t.sessions, after_t.kv_bytes_used) == (before.sessions, before.kv_bytes_used)
    assert held_d.kv_bytes_used > after_d.kv_bytes_used
    assert after_d.sessions == held_d.sessions - 2
    assert (held_t.role, held_d.role) == ("target", "draft")
    assert held_t.model == TARGET and held_d.model == DRAFT and held_t.tp_size == 1
