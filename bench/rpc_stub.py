"""Stub draft and target servers for the RPC overhead benchmark: the real servers, no model.

``python -m bench.rpc_stub draft|target [serving flags]`` runs the real gRPC server
(interceptor, validation, conversion, model executor thread, health) with a
backend that does no model work: the draft answers every session with k tokens
and a sparse q of 64 entries over a 150k vocabulary, the target accepts every
draft. Compute is then microseconds, so ``wall - compute_ns`` is what the RPC
path itself costs — as on a GPU replica, where the CPU waits while the device
computes, and unlike a CPU model that competes for the cores with the transport.

``--memoize-conversion`` (for ``bench.rpc_overhead --floor``): each server converts
the first request of each batch size and reuses that conversion for every later one
(the draft also its first response per batch size), so a call costs what the
framework, the transport and the hop to the model thread cost, with the request's
validation and conversion at ~0. A floor to measure against, never a server to run:
it answers every request as if it were the first of its size.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specserve.draft_service.backend import DraftBackend
from specserve.draft_service.config import DraftServerConfig
from specserve.draft_service.server import start as start_draft
from specserve.draft_service.servicer import DraftServicer
from specserve.engine.drafter import DraftInput, DraftOutcome
from specserve.engine.kv_cache import KVStats
from specserve.engine.rejection import Proposal, Verdict
from specserve.engine.sampling import SamplingParams
from specserve.engine.verifier import VerifyInput, VerifyOutcome
from specserve.serving.cli_args import add_server_arguments, server_options
from specserve.serving.server import ServerOptions, identity_of, run_process
from specserve.target_service.backend import TargetBackend, TargetLoad, Verified
from specserve.target_service.config import TargetServerConfig
from specserve.target_service.server import start as start_target
from specserve.target_service.servicer import TargetServicer
from specserve.v1 import common_pb2, draft_pb2, target_pb2
from specserve.wire import draft_wire, sparse_q, target_wire
from specserve.wire.common_wire import SessionLimit

VOCAB = 150_000
SUPPORT = 64
MAX_K = 16


class StubDrafter:
    """Proposes k tokens per session, each with a fixed sparse q of SUPPORT entries."""

    name = "model"
    context_tokens = 1 << 20  # no session limit in the way

    def __init__(self, vocab: int = VOCAB, support: int = SUPPORT) -> None:
        gen = torch.Generator().manual_seed(0)
        ids = torch.stack([torch.randperm(vocab, generator=gen)[:support] for _ in range(MAX_K)])
        self.q_ids = ids  # [16, m] distinct ids per row; column 0 is the drafted token
        self.q_probs = torch.full((MAX_K, support), 1.0 / support)  # [16, m]

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftOutcome]:
        out = []
        for x in inputs:
            ids, probs = self.q_ids[: x.k], self.q_probs[: x.k]
            out.append(DraftOutcome(Proposal(ids[:, 0].tolist(), q_ids=ids, q_probs=probs)))
        return out

    def release(self, session_id: str) -> bool:
        return False

    def sessions(self) -> int:
        return 0

    def kv_stats(self) -> KVStats:  # a pool of 2^16 blocks: no session limit in the way
        return KVStats(0, 0, 0, 1 << 16, 16, 0)


class StubTarget(TargetBackend):
    """Accepts every draft; the next token is always 1. Requests are validated as usual."""

    def __init__(self, vocab: int = VOCAB) -> None:  # no verifier, no model
        self.vocab = vocab
        self.model_name = "stub"
        self.dtype = "float32"
        self.tp_size = 1
        self.load = TargetLoad()
        self.kv_transfer = None  # no ExportKv / ImportKv
        self.limit = SessionLimit(1 << 20, 1 << 20)  # no session limit in the way

    def verify(self, calls: Sequence[Sequence[VerifyInput]]) -> list[Verified]:
        return [
            Verified(
                [VerifyOutcome(Verdict(accepted=len(x.proposal.tokens), next_token=1)) for x in c],
                frozenset(),
            )
            for c in calls
        ]

    def release(self, calls: Sequence[Sequence[str]]) -> list[int]:
        return [0 for _ in calls]

    def progress_modules(self) -> list[object]:  # no model: batches alone move the counter
        return []

    def close(self) -> None:  # no rank group to stop
        pass


async def handler_cost(batches: Sequence[int], reps: int, k: int = 4) -> dict[str, list[float]]:
    """Server-side handling per call, in this process, no transport (ms p50 per batch size).

    Parse the request bytes, run the servicer (validation, conversion, the round trip
    through the model thread, response), serialise the response; minus compute_ns.
    """
    options = ServerOptions(batch_window_ms=0)
    draft_stub = StubDrafter()

    def load_draft() -> DraftBackend:
        return DraftBackend(draft_stub, model_name="stub", dtype="float32", vocab=VOCAB)  # type: ignore[arg-type]

    draft = await start_draft(DraftServerConfig(model=None, server=options), load=load_draft)
    target = await start_target(TargetServerConfig(model="stub", server=options), load=StubTarget)
    await asyncio.to_thread(draft.executor.ready.wait)
    await asyncio.to_thread(target.executor.ready.wait)
    propose, verify = DraftServicer(draft), TargetServicer(target)
    out: dict[str, list[float]] = {"propose": [], "verify": []}
    for b in batches:
        sampling = common_pb2.SamplingConfig(temperature=1.0)
        p_req = draft_pb2.ProposeRequest(
            sessions=[
                draft_pb2.DraftSession(
                    session_id=f"s{i}", new_tokens=[5] * 16, k=k, sampling=sampling
                )
                for i in range(b)
            ]
        )
        proposal = draft_stub.propose([DraftInput("x", 0, [5], k, SamplingParams(), 0)])[0]
        assert proposal.proposal is not None
        q = sparse_q.encode(proposal.proposal)
        v_req = target_pb2.VerifyRequest(
            sessions=[
                target_pb2.VerifySession(
                    session_id=f"s{i}",
                    new_tokens=[5],
                    draft_tokens=proposal.proposal.tokens,
                    q=q,
                    sampling=sampling,
                )
                for i in range(b)
            ]
        )
        for name, handler, req, cls in (
            ("propose", propose.Propose, p_req, draft_pb2.ProposeRequest),
            ("verify", verify.Verify, v_req, target_pb2.VerifyRequest),
        ):
            data, times = req.SerializeToString(), []
            for _ in range(reps):
                t0 = time.perf_counter_ns()
                response = await handler(cls.FromString(data), None)  # type: ignore[arg-type]
                response.SerializeToString()
                times.append(time.perf_counter_ns() - t0 - response.compute_ns)
            out[name].append(statistics.median(times[reps // 10 :]) / 1e6)
    await draft.stop(0)
    await target.stop(0)
    return out


def _memoized(convert: Callable[..., Any], key: Callable[..., int]) -> Callable[..., Any]:
    """``convert``, computed once per ``key(*args)`` and reused."""
    seen: dict[int, Any] = {}

    def once(*args: Any) -> Any:
        k = key(*args)
        if k not in seen:
            seen[k] = convert(*args)
        return seen[k]

    return once


def memoize_conversion() -> None:
    """The servicers' request conversion (and the draft's response building) computed
    once per batch size in this process (see the module doc)."""
    target_wire.verify_inputs = _memoized(target_wire.verify_inputs, lambda r, *_: len(r.sessions))
    draft_wire.draft_calls = _memoized(draft_wire.draft_calls, lambda r, *_: len(r.sessions))
    draft_wire.propose_response = _memoized(draft_wire.propose_response, lambda _, c: len(c))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rpc_stub", description=__doc__)
    parser.add_argument("role", choices=["draft", "target"])
    add_server_arguments(parser, kv_budget="1MiB")
    parser.add_argument(
        "--memoize-conversion",
        action="store_true",
        help="convert one request per batch size and reuse it: the framework's floor",
    )
    args = parser.parse_args(argv)
    options = server_options(args)
    if args.memoize_conversion:
        memoize_conversion()
    if args.role == "draft":
        draft = DraftServerConfig(model=None, server=options)
        stub = StubDrafter()

        def load_draft() -> DraftBackend:
            return DraftBackend(stub, model_name="stub", dtype="float32", vocab=VOCAB)  # type: ignore[arg-type]

        identity = identity_of(options, "draft", "stub")
        return run_process(lambda: start_draft(draft, load=load_draft), options, identity)
    target = TargetServerConfig(model="stub", server=options)
    identity = identity_of(options, "target", "stub")
    return run_process(lambda: start_target(target, load=StubTarget), options, identity)


if __name__ == "__main__":
    sys.exit(main())
