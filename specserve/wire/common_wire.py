"""Protobuf <-> engine types at the service edge, with every check a request needs.

Nothing below a servicer sees a pb object. Requests are validated here, before they
reach the model thread, so a bad session is answered ``INVALID_ARGUMENT`` with a
sentence naming it and never spoils a batch it would have shared a forward with:

* session ids: not empty, not twice in one batch; at most ``MAX_SESSIONS`` per call;
* enums: a value the contract does not define is rejected (proto3 lets it through);
* ``k`` in 0..16; token ids inside the vocabulary; sampling parameters valid;
* a session's tokens (``start`` + new + drafts) within the replica's
  :class:`SessionLimit`: the model's context (else INVALID_ARGUMENT) and what its
  KV budget can ever hold (else RESOURCE_EXHAUSTED);
* sparse q: see :mod:`specserve.wire.sparse_q`.

The client side of the same messages (the orchestrator's calls, the benchmarks'
``RoundClient``) is here too, so both ends of a field are read and written in one place.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.engine.drafter import DrafterKind
from specserve.engine.errors import InvalidArgument, KVBudgetExceeded
from specserve.engine.sampling import SamplingParams, SamplingRule
from specserve.v1 import common_pb2

MAX_SESSIONS = 1024  # per call; far above any useful forward batch

DRAFTER_KINDS = {
    common_pb2.DRAFTER_UNSPECIFIED: DrafterKind.MODEL,
    common_pb2.DRAFTER_MODEL: DrafterKind.MODEL,
    common_pb2.DRAFTER_NGRAM: DrafterKind.NGRAM,
    common_pb2.DRAFTER_NONE: DrafterKind.NONE,
}
RULE_NAMES = {
    common_pb2.SAMPLING_RULE_UNSPECIFIED: SamplingRule.COUPLED,
    common_pb2.SAMPLING_RULE_COUPLED: SamplingRule.COUPLED,
    common_pb2.SAMPLING_RULE_REJECTION: SamplingRule.REJECTION,
}
RULE_ENUMS = {
    SamplingRule.COUPLED: common_pb2.SAMPLING_RULE_COUPLED,
    SamplingRule.REJECTION: common_pb2.SAMPLING_RULE_REJECTION,
}
DRAFTER_ENUMS = {
    DrafterKind.MODEL: common_pb2.DRAFTER_MODEL,
    DrafterKind.NGRAM: common_pb2.DRAFTER_NGRAM,
    DrafterKind.NONE: common_pb2.DRAFTER_NONE,
}


# -- shared checks -------------------------------------------------------------------


@dataclass(frozen=True)
class SessionLimit:
    """How many tokens one session may hold on a replica, and why."""

    context: int  # positions the model serves (max_position_embeddings)
    kv_tokens: int  # tokens the whole KV pool holds, with every other session evicted

    @property
    def tokens(self) -> int:
        return min(self.context, self.kv_tokens)

    def check(self, sid: str, start: int, new: int, drafts: int = 0, steps: int = 1) -> None:
        """Before any work: InvalidArgument past the model's context (no replica of this
        model can serve it), KVBudgetExceeded past what the KV pool can ever hold. Each
        plain step after the first caches one more token."""
        total = start + new + drafts + steps - 1
        if total <= self.tokens:
            return
        more = f"{drafts} drafts" if steps == 1 else f"{steps - 1} more steps"
        what = f"session {sid!r}: {total} tokens (start {start} + {new} new + {more})"
        if total > self.context:
            raise InvalidArgument(
                f"{what} exceed the model's context of {self.context} tokens; send a shorter prompt"
            )
        raise KVBudgetExceeded(
            f"{what} exceed what this replica's KV budget can ever hold ({self.kv_tokens} "
            "tokens); send a shorter prompt"
        )


def check_session_ids(ids: Sequence[str]) -> None:
    """Every id present, none twice, not too many."""
    if len(ids) > MAX_SESSIONS:
        raise InvalidArgument(f"a call may name at most {MAX_SESSIONS} sessions, got {len(ids)}")
    seen: set[str] = set()
    for i, sid in enumerate(ids):
        if not sid:
            raise InvalidArgument(f"session {i} of the batch has an empty session_id")
        if sid in seen:
            raise InvalidArgument(f"session id {sid!r} appears more than once in one batch")
        seen.add(sid)


def check_tokens(tokens: Sequence[int], vocab: int, field: str, sid: str) -> list[int]:
    """``tokens`` as a list, or InvalidArgument naming the first id outside ``[0, vocab)``."""
    out = tokens if isinstance(tokens, list) else list(tokens)
    if out and (min(out) < 0 or max(out) >= vocab):
        bad = next(t for t in out if not 0 <= t < vocab)
        raise InvalidArgument(
            f"session {sid!r}: {field} holds token id {bad}, outside the vocabulary "
            f"(0..{vocab - 1})"
        )
    return out


def sampling_params(pb: common_pb2.SamplingConfig, sid: str) -> SamplingParams:
    """SamplingConfig -> SamplingParams; an unset top_p (0) means 1 (off)."""
    try:
        return _sampling_params(pb.temperature, pb.top_k, pb.top_p, pb.seed, pb.rule)
    except InvalidArgument as e:
        raise InvalidArgument(f"session {sid!r}: {e}") from None


# A session sends the same config every round, and building (and validating) the params
# costs more than the lookup; SamplingParams is frozen, so sessions may share one. A
# config that fails raises each time (exceptions are not cached).
@functools.lru_cache(maxsize=1 << 16)
def _sampling_params(
    temperature: float, top_k: int, top_p: float, seed: int, rule: int
) -> SamplingParams:
    return SamplingParams(
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p) if top_p != 0 else 1.0,
        seed=int(seed),
        rule=sampling_rule(rule, "sampling rule"),
    )


def sampling_pb(params: SamplingParams) -> common_pb2.SamplingConfig:
    return common_pb2.SamplingConfig(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed & ((1 << 64) - 1),
        rule=RULE_ENUMS[params.rule],
    )


def sampling_rule(value: int, what: str) -> SamplingRule:
    """SamplingRule enum -> the engine's rule (unspecified = coupled)."""
    if value not in RULE_NAMES:
        known = ", ".join(common_pb2.SamplingRule.Name(v) for v in RULE_NAMES)
        raise InvalidArgument(f"{what} {value} is not one of {known}")
    return RULE_NAMES[value]


def drafter_kind(value: int, sid: str) -> DrafterKind:
    """Drafter enum -> the engine's :class:`DrafterKind` (unspecified = the model)."""
    if value not in DRAFTER_KINDS:
        known = ", ".join(common_pb2.Drafter.Name(v) for v in DRAFTER_KINDS)
        raise InvalidArgument(f"session {sid!r}: drafter {value} is not one of {known}")
    return DRAFTER_KINDS[value]


def load_report(
    *,
    replica_id: str,
    role: str,
    model: str,
    dtype: str,
    sessions: int,
    kv_bytes_used: int,
    kv_bytes_free: int,
    queue_depth: int,
    tp_size: int = 1,
    kv_fingerprint: bytes = b"",
    kv_bytes_per_token: int = 0,
    progress_steps: int = 0,
    busy: bool = False,
    model_cpu_ns: int = 0,
    limit: SessionLimit | None = None,
    data_port: int = 0,
) -> common_pb2.LoadReport:
    return common_pb2.LoadReport(
        data_port=data_port,
        replica_id=replica_id,
        role=role,
        model=model,
        sessions=sessions,
        kv_bytes_used=kv_bytes_used,
        kv_bytes_free=kv_bytes_free,
        queue_depth=queue_depth,
        tp_size=tp_size,
        dtype=dtype,
        kv_fingerprint=kv_fingerprint,
        kv_bytes_per_token=kv_bytes_per_token,
        progress_steps=progress_steps,
        busy=busy,
        model_cpu_ns=model_cpu_ns,
        max_context_tokens=limit.context if limit is not None else 0,
        kv_capacity_tokens=limit.kv_tokens if limit is not None else 0,
    )
