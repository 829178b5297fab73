"""Sparse q written for a whole response at once equals q encoded session by session."""

from __future__ import annotations

import torch

from specserve.engine.drafter import DraftCall, DrafterKind, DraftInput, DraftOutcome
from specserve.engine.rejection import Proposal
from specserve.engine.sampling import SamplingParams
from specserve.v1 import common_pb2
from specserve.wire import draft_wire, sparse_q


def sparse(k: int, m: int, seed: int) -> Proposal:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(1000, generator=gen)[:m] for _ in range(k)])  # [k, m]
    probs = torch.softmax(torch.randn(k, m, generator=gen), dim=-1)  # [k, m]
    return Proposal(ids[:, 0].tolist(), q_ids=ids, q_probs=probs)


def test_encode_into_matches_encode_per_proposal() -> None:
    proposals = [
        sparse(4, 64, 0),
        Proposal(tokens=[5, 6]),  # point masses: no q
        sparse(2, 8, 1),  # another support width
        sparse(3, 64, 2),
        Proposal(tokens=[], q_ids=torch.zeros(0, 64, dtype=torch.long), q_probs=torch.zeros(0, 64)),
        sparse(1, 8, 3),
    ]
    batched = [common_pb2.SparseQ() for _ in proposals]
    sparse_q.encode_into(proposals, batched)
    for p, q in zip(proposals, batched, strict=True):
        one = sparse_q.encode(p)
        assert q == (one if one is not None else common_pb2.SparseQ())


def test_propose_response_sets_q_only_where_there_is_one() -> None:
    params = SamplingParams(temperature=1.0)
    calls = [
        DraftCall(DrafterKind.MODEL, DraftInput(f"s{i}", 0, [1, 2], 4, params, 0)) for i in range(4)
    ]
    outcomes = [
        DraftOutcome(sparse(4, 16, 7)),
        DraftOutcome(Proposal(tokens=[3, 4])),
        DraftOutcome.needs_history(),
        DraftOutcome(sparse(2, 16, 8)),
    ]
    response = draft_wire.propose_response(outcomes, calls)
    has_q = [r.HasField("q") for r in response.results]
    assert has_q == [True, False, False, True]
    for r, o in zip(response.results, outcomes, strict=True):
        if o.proposal is not None and r.HasField("q"):
            assert r.q == sparse_q.encode(o.proposal)
