"""Export and import of KV chunks: an exact round trip, and refusals that change nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specserve.engine.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVBudgetExceeded,
    NotFound,
)
from specserve.engine.kv_chunks import KvLayout, chunk_digest, digest_key_of
from specserve.engine.kv_transfer import KvChunk, KvTransfer
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.rejection import Proposal
from specserve.engine.sampling import SamplingParams
from specserve.engine.tiny import tiny_model
from specserve.engine.verifier import TargetVerifier, VerifyInput

C = 16  # positions per chunk
PROMPT = [(i * 53 + 11) % 256 for i in range(70)]
BUDGET = 8 << 20


def replica(seed: int = 3, budget: int = BUDGET) -> tuple[TargetVerifier, KvTransfer]:
    verifier = TargetVerifier(tiny_model(seed), budget)
    return verifier, KvTransfer.for_model(verifier.model, verifier.kv, 256)


def prefill(verifier: TargetVerifier, sid: str, tokens: list[int]) -> None:
    x = VerifyInput(sid, 0, tokens, Proposal(tokens=[]), SamplingParams(), 0)
    [outcome] = verifier.verify([x])
    assert outcome.verdict is not None


def forward(model: CausalLM, verifier: TargetVerifier, sid: str, tokens: list[int]) -> torch.Tensor:
    """Logits of every one of ``tokens`` run after the session's cache."""
    verifier.kv.reserve({sid: len(tokens)})
    return model([SeqInput(sid, tokens, num_logits=len(tokens))], verifier.kv)


@pytest.fixture
def exported() -> tuple[TargetVerifier, list[KvChunk]]:
    source, kv = replica()
    prefill(source, "a", PROMPT)
    return source, kv.export("a", PROMPT[:64], C, 0)


def test_export_import_round_trip_gives_identical_logits(
    exported: tuple[TargetVerifier, list[KvChunk]],
) -> None:
    source, chunks = exported
    assert [c.start for c in chunks] == [0, 16, 32, 48]
    dest, kv = replica()  # another replica of the same model
    assert kv.import_("b", PROMPT, 0, chunks) == 64
    assert dest.kv.length("b") == 64
    assert torch.equal(dest.kv.read("b", 0, 64), source.kv.read("a", 0, 64))
    source.kv.truncate("a", 64)
    tail = [*PROMPT[64:], 9, 8, 7]  # the tail a restored replica prefills, then decodes on
    want = forward(source.model, source, "a", tail)
    got = forward(dest.model, dest, "b", tail)
    assert torch.equal(got, want)


def test_an_import_split_over_calls_continues_the_cache(
    exported: tuple[TargetVerifier, list[KvChunk]],
) -> None:
    source, chunks = exported
    dest, kv = replica()
    assert kv.import_("b", PROMPT[:32], 0, chunks[:2]) == 32
    assert kv.import_("b", PROMPT, 32, chunks[2:]) == 64
    assert torch.equal(dest.kv.read("b", 0, 64), source.kv.read("a", 0, 64))
    # start 0 replaces a longer cache
    assert kv.import_("b", PROMPT, 0, chunks[:1]) == 16
    assert dest.kv.length("b") == 16


def test_export_only_from_a_first_chunk(exported: tuple[TargetVerifier, list[KvChunk]]) -> None:
    source, chunks = exported
    kv = KvTransfer.for_model(source.model, source.kv, 256)
    later = kv.export("a", PROMPT[:64], C, 2)
    assert later == chunks[2:]


def refused(
    kv: KvTransfer,
    error: type[Exception],
    match: str,
    chunks: list[KvChunk],
    *,
    sid: str = "b",
    tokens: list[int] = PROMPT,
    start: int = 0,
) -> None:
    """The import raises ``error`` and leaves the pool exactly as it was."""
    pool = kv.pool
    before = (pool.stats(), {s: pool.length(s) for s in pool.alloc.sessions()})
    with pytest.raises(error, match=match):
        kv.import_(sid, tokens, start, chunks)
    assert (pool.stats(), {s: pool.length(s) for s in pool.alloc.sessions()}) == before


def test_chunks_of_another_model_are_refused(
    exported: tuple[TargetVerifier, list[KvChunk]],
) -> None:
    _, chunks = exported
    _, kv = replica(seed=4)
    refused(kv, FailedPrecondition, "another model or dtype", chunks)
    bf16 = TargetVerifier(tiny_model(3).to(torch.bfloat16), BUDGET)  # same weights, other dtype
    refused(KvTransfer.for_model(bf16.model, bf16.kv, 256), FailedPrecondition, "dtype", chunks)


def test_import_refusals_change_nothing(exported: tuple[TargetVerifier, list[KvChunk]]) -> None:
    _, chunks = exported
    dest, kv = replica()
    prefill(dest, "b", PROMPT[:5])  # a cache the refused imports must leave alone
    other_layout = KvLayout(2, 2, 16, "bfloat16")
    refused(
        kv,
        FailedPrecondition,
        "holds 2 layers x 2 KV heads x 16 in bfloat16",
        [dataclasses.replace(c, layout=other_layout) for c in chunks],
    )
    refused(kv, InvalidArgument, "another token prefix", chunks, tokens=[1, *PROMPT[1:]])
    refused(kv, InvalidArgument, "only 10 tokens were given", chunks, tokens=PROMPT[:10])
    refused(kv, InvalidArgument, "consecutive", [chunks[0], chunks[2]])
    refused(kv, InvalidArgument, "not a multiple", chunks[1:], start=8)
    refused(kv, InvalidArgument, "at least one chunk", [])
    refused(kv, InvalidArgument, "outside the vocabulary", chunks, tokens=[300, *PROMPT[1:]])
    short = dataclasses.replace(chunks[1], data=chunks[1].data[:-4])
    refused(kv, InvalidArgument, "bytes, got", [chunks[0], short])
    refused(kv, FailedPrecondition, "holds fewer tokens of it", chunks[2:], start=32)
    refused(kv, FailedPrecondition, "holds fewer tokens of it", chunks[2:], start=32, sid="new")


def test_a_full_budget_refuses_the_import_and_keeps_other_sessions(
    exported: tuple[TargetVerifier, list[KvChunk]],
) -> None:
    _, chunks = exported
    block = 2 * 2 * 16 * 2 * 16 * 4  # layers * K/V * block_size * heads * head_dim * 4 bytes
    dest, kv = replica(budget=3 * block)  # 48 positions
    prefill(dest, "other", PROMPT[:10])
    refused(kv, KVBudgetExceeded, "KV cache is full", chunks)
    assert kv.import_("b", PROMPT, 0, chunks[:3]) == 48  # fits once "other" is evicted
    assert "other" not in dest.kv


def test_export_refusals() -> None:
    source, kv = replica()
    prefill(source, "a", PROMPT[:40])
    with pytest.raises(NotFound, match="no KV cache"):
        kv.export("nobody", PROMPT[:32], C, 0)
    with pytest.raises(FailedPrecondition, match="holds fewer tokens than the 48 to export"):
        kv.export("a", PROMPT[:48], C, 0)
    with pytest.raises(InvalidArgument, match="whole chunks of 16, got 40"):
        kv.export("a", PROMPT[:40], C, 0)
    with pytest.raises(InvalidArgument, match="past the last"):
        kv.export("a", PROMPT[:32], C, 2)
    small = KvTransfer(source.kv, kv.fingerprint, 256, max_export_bytes=kv.bytes_per_token * C)
    with pytest.raises(InvalidArgument, match="ask for at most 1 per call"):
        small.export("a", PROMPT[:32], C, 0)
    assert len(small.export("a", PROMPT[:32], C, 1)) == 1


def test_export_errors_say_nothing_of_the_session_history() -> None:
    """A caller who knows a session id but not its tokens learns neither its token ids
    nor its length from the errors: the messages are the same whatever the session holds
    (ExportKv's errors once named the first differing position and the cached token)."""
    secret = [211, 233, 239, 241, 251, 199, 197, 193] * 4 + [181] * 5  # 37 tokens
    messages = []
    for held in (secret, [5] * 37):
        source, kv = replica()
        prefill(source, "victim", held)
        for guess in ([211] * 16, [7] * 16, [211, 233, 7] + [7] * 13, [5] * 48):
            with pytest.raises((InvalidArgument, FailedPrecondition)) as info:
                kv.export("victim", guess, C, 0)
            messages.append(str(info.value))
    assert messages[:4] == messages[4:]  # independent of what the cache holds
    for message in messages:
        assert not any(str(t) in message for t in {*secret, 37, 36}), message


def test_an_import_checks_each_chunks_digest(
    exported: tuple[TargetVerifier, list[KvChunk]],
) -> None:
    """K/V altered after the export (finite, plausible values) is refused; so is a chunk
    without a digest, and one whose digest was made under another key."""
    _, chunks = exported
    assert all(len(c.digest) == 32 for c in chunks)
    dest, kv = replica()
    data = bytearray(chunks[1].data)
    data[:4] = b"\x00\x00\x80\x3f"  # 1.0f: finite garbage the non-finite check lets by
    forged = dataclasses.replace(chunks[1], data=bytes(data))
    refused(kv, InvalidArgument, "digest does not match", [chunks[0], forged])
    undigested = dataclasses.replace(chunks[0], digest=b"")
    refused(kv, FailedPrecondition, "carries no digest", [undigested])
    # The forger recomputes an unkeyed digest: a replica with an internal token refuses it.
    first = dataclasses.replace(chunks[0], data=bytes(data[: len(chunks[0].data)]))
    resealed = dataclasses.replace(first, digest=chunk_digest(first.key, first.data))
    assert kv.check("b", PROMPT, 0, [resealed])  # unkeyed: a replica without a token takes it
    keyed = KvTransfer.for_model(dest.model, dest.kv, 256, digest_key=digest_key_of("t" * 32))
    refused(keyed, InvalidArgument, "digest does not match", [resealed])
    refused(keyed, InvalidArgument, "digest does not match", chunks[:1])  # exported unkeyed


def test_keyed_chunks_round_trip_between_replicas_of_one_deployment() -> None:
    key = digest_key_of("deployment-token-0123456789")
    source, _ = replica()
    prefill(source, "a", PROMPT)
    chunks = KvTransfer.for_model(source.model, source.kv, 256, digest_key=key).export(
        "a", PROMPT[:32], C, 0
    )
    dest = TargetVerifier(tiny_model(3), BUDGET)
    kv = KvTransfer.for_model(dest.model, dest.kv, 256, digest_key=key)
    assert kv.import_("b", PROMPT[:32], 0, chunks) == 32


def test_an_import_onto_a_live_session_of_other_tokens_is_refused(
    exported: tuple[TargetVerifier, list[KvChunk]],
) -> None:
    """Overwriting a live session's cache with another history needs a Release first."""
    _, chunks = exported
    dest, kv = replica()
    other = [9, *PROMPT[1:20]]
    prefill(dest, "live", other)
    refused(kv, FailedPrecondition, "other tokens than the import's", chunks, sid="live")
    assert dest.kv.tokens("live").tolist() == other
    prefill(dest, "prefix", PROMPT[:20])  # the same history, shorter: replaced
    assert kv.import_("prefix", PROMPT, 0, chunks) == 64
