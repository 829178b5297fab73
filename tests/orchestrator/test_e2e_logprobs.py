"""Log-probabilities through the whole stack: the target computes them, the client gets them.

They come from the target's distribution, so speculation must not change them: the
same greedy request with drafts (proposed and accepted) and without gives the same
numbers. Under sampling they are the distribution the token was drawn from (top-k
applied: at most k alternatives, their probabilities summing to 1).
"""

from __future__ import annotations

import math

import grpc
import pytest

from specserve.client import request
from specserve.v1 import generate_pb2, generate_pb2_grpc
from tests.orchestrator.stack import Stack

pytestmark = pytest.mark.redis

PROMPT = [9, 4, 77, 9, 4, 77, 9, 4, 77]


def generate(stack: Stack, req: generate_pb2.GenerateRequest) -> generate_pb2.GenerateResponse:
    with grpc.insecure_channel(stack.address) as channel:
        return generate_pb2_grpc.GenerationStub(channel).Generate(req, timeout=60)


def test_greedy_logprobs_are_the_targets_and_speculation_does_not_change_them(
    stack: Stack,
) -> None:
    spec = generate(stack, request(PROMPT, max_new_tokens=24, logprobs=3, drafter="model", k=4))
    plain = generate(stack, request(PROMPT, max_new_tokens=24, logprobs=3, drafter="none"))
    assert spec.usage.drafted_tokens > 0 and spec.usage.accepted_tokens > 0
    assert list(spec.token_ids) == list(plain.token_ids)
    assert len(spec.logprobs) == len(spec.token_ids) == 24
    for token, a, b in zip(spec.token_ids, spec.logprobs, plain.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert a.logprob <= 0
        assert len(a.top_ids) == 3 and list(a.top_ids) == list(b.top_ids)
        assert a.top_ids[0] == token  # greedy: the token is the most likely one
        assert a.top_logprobs[0] == pytest.approx(a.logprob)
        assert list(a.top_logprobs) == sorted(a.top_logprobs, reverse=True)
        assert a.token == f" {token}"  # no tokenizer: ids written out
    stream_req = request(PROMPT, max_new_tokens=24, logprobs=3, drafter="model", k=4)
    with grpc.insecure_channel(stack.address) as channel:
        stream = list(generate_pb2_grpc.GenerationStub(channel).GenerateStream(stream_req))
    streamed = [t for m in stream for t in m.logprobs]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in plain.logprobs])
    assert all(len(m.logprobs) == len(m.token_ids) for m in stream)


def test_sampled_logprobs_follow_the_sampling_distribution(stack: Stack) -> None:
    req = request(PROMPT, max_new_tokens=16, temperature=0.8, top_k=2, seed=5, logprobs=5)
    got = generate(stack, req)
    assert len(got.logprobs) == 16
    for token, t in zip(got.token_ids, got.logprobs, strict=True):
        assert 1 <= len(t.top_ids) <= 2  # top_k=2: nothing else can be drawn
        assert token in t.top_ids
        assert sum(math.exp(lp) for lp in t.top_logprobs) == pytest.approx(1.0, abs=1e-4)


def test_no_logprobs_unless_asked(stack: Stack) -> None:
    assert not generate(stack, request(PROMPT, max_new_tokens=4)).logprobs
