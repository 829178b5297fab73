"""The target backend asks its verifier about sessions once per batch, never one by one.

A Ray-launched TP verifier answers every call with a Ray round trip, so membership
(which stale sessions are unknown here) and release must be one call per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from specserve.engine.errors import FailedPrecondition
from specserve.engine.kv_cache import KVStats
from specserve.engine.kv_transfer import ExportInput, ImportInput
from specserve.engine.rejection import Proposal, Verdict
from specserve.engine.sampling import SamplingParams
from specserve.engine.tiny import tiny_config
from specserve.engine.verifier import VerifyInput, VerifyOutcome
from specserve.target_service.backend import TargetBackend


class CountingVerifier:
    """A verifier that holds ``held``, answers start > 0 as stale, and counts calls."""

    vocab_limit = 256
    config = tiny_config()

    def __init__(self, held: set[str]) -> None:
        self.held = held
        self.calls: list[str] = []

    @property
    def kv(self) -> Any:
        raise AssertionError("the backend must not ask about sessions one by one")

    def holding(self, session_ids: Sequence[str]) -> frozenset[str]:
        self.calls.append("holding")
        return frozenset(session_ids) & self.held

    def verify(self, inputs: Sequence[VerifyInput]) -> list[VerifyOutcome]:
        self.calls.append("verify")
        return [
            VerifyOutcome(None, stale=True) if x.start else VerifyOutcome(Verdict(0, 1))
            for x in inputs
        ]

    def release(self, session_id: str) -> bool:
        raise AssertionError("the backend must release a batch in one call")

    def release_sessions(self, session_ids: Sequence[str]) -> frozenset[str]:
        self.calls.append("release_sessions")
        released = frozenset(session_ids) & self.held
        self.held -= released
        return released

    def kv_stats(self) -> KVStats:
        self.calls.append("kv_stats")
        return KVStats(len(self.held), 0, 0, 0, 16, 0)

    def sessions(self) -> int:
        return len(self.held)

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        self.calls.append("close")


def _input(session_id: str, start: int) -> VerifyInput:
    return VerifyInput(session_id, start, [5], Proposal(tokens=[]), SamplingParams(), 0)


def test_coalesced_calls_ask_about_their_sessions_in_one_call() -> None:
    verifier = CountingVerifier(held={"a", "b"})
    backend = TargetBackend(verifier, model_name="m", dtype="float32", tp_size=2)
    verifier.calls.clear()
    calls = [[_input("a", 3), _input("new", 0)], [_input("gone", 9), _input("b", 0)]]
    out = backend.verify(calls)
    assert verifier.calls == ["holding", "verify", "kv_stats"]
    assert [v.unknown for v in out] == [frozenset(), frozenset({"gone"})]  # "a" is held
    assert [o.stale for o in out[0].outcomes] == [True, False]


def test_release_is_one_call_for_every_coalesced_call() -> None:
    verifier = CountingVerifier(held={"a", "b", "c"})
    backend = TargetBackend(verifier, model_name="m", dtype="float32")
    verifier.calls.clear()
    assert backend.release([["a", "x", "a"], ["b"], []]) == [1, 1, 0]
    assert verifier.calls == ["release_sessions", "kv_stats"]
    assert backend.load.sessions == 1
    backend.close()
    assert verifier.calls[-1] == "close"


def test_a_tensor_parallel_backend_refuses_kv_export_and_import() -> None:
    backend = TargetBackend(
        CountingVerifier(held={"a"}), model_name="m", dtype="float32", tp_size=2
    )
    call = ExportInput("a", [1] * 16, 16, 0)
    with pytest.raises(FailedPrecondition, match=r"tensor-parallel \(--tp 2\)"):
        backend.export_kv([call])
    with pytest.raises(FailedPrecondition, match="re-prefill"):
        backend.import_kv([ImportInput("a", [1] * 16, 0, [])])
