"""Admission bounds as pure functions: sizes, token limits, codes, the max_new_tokens cut."""

from __future__ import annotations

import pytest

from specserve.engine.errors import InvalidArgument, KVBudgetExceeded
from specserve.engine.sampling import SamplingParams
from specserve.orchestrator.api.admission import (
    AdmissionConfig,
    check_request,
    check_tokens,
    max_new_tokens,
    prompt_bytes,
    request_bytes,
)
from specserve.orchestrator.types import ChatMessage, GenerateParams, Prompt
from specserve.wire.common_wire import SessionLimit

SMALL = AdmissionConfig(
    max_prompt_tokens=100,
    max_prompt_bytes=50,
    max_stop_strings=3,
    max_stop_bytes=8,
    max_stop_total_bytes=12,
)


def params(prompt: Prompt, stop: tuple[str, ...] = ()) -> GenerateParams:
    return GenerateParams(prompt=prompt, sampling=SamplingParams(), stop=stop)


@pytest.mark.parametrize(
    ("prompt", "stop", "match"),
    [
        (Prompt(text="x" * 51), (), "51 bytes; at most 50"),
        (Prompt(text="é" * 26), (), "52 bytes"),  # bytes, not characters
        (Prompt(chat=(ChatMessage("user", "y" * 47),)), (), "51 bytes"),  # role counted
        (Prompt(token_ids=(1,)), ("a", "b", "c", "d"), "4 stop strings; at most 3"),
        (Prompt(token_ids=(1,)), ("123456789",), "stop string 0 is 9 bytes"),
        (Prompt(token_ids=(1,)), ("12345678", "12345"), "13 bytes together; at most 12"),
    ],
)
def test_sizes_are_refused_before_tokenizing(
    prompt: Prompt, stop: tuple[str, ...], match: str
) -> None:
    with pytest.raises(InvalidArgument, match=match):
        check_request(params(prompt, stop), SMALL)


def test_requests_inside_the_bounds_pass() -> None:
    check_request(params(Prompt(text="x" * 50), ("12345678", "1234")), SMALL)
    check_request(params(Prompt(token_ids=tuple(range(10**4)))), SMALL)  # counted later
    assert prompt_bytes(Prompt(token_ids=(1, 2))) == 0


def test_token_limits_and_their_codes() -> None:
    limit = SessionLimit(context=80, kv_tokens=60)
    check_tokens(50, 10, SMALL, limit)  # exactly the KV limit
    with pytest.raises(KVBudgetExceeded, match="at most 60 tokens of one session"):
        check_tokens(50, 11, SMALL, limit)
    with pytest.raises(InvalidArgument, match="the model's context is 80 tokens"):
        check_tokens(0, 81, SMALL, limit)
    with pytest.raises(InvalidArgument, match=r"101 tokens \(90 of the session and 11 new\)"):
        check_tokens(90, 11, SMALL, None)
    check_tokens(0, 100, SMALL, None)  # no target answered: only max_prompt_tokens


def test_max_new_tokens_is_cut_so_the_session_fits() -> None:
    limit = SessionLimit(context=4096, kv_tokens=10**6)
    assert max_new_tokens(16, 0, 4096, limit) == 1  # the full context still emits one
    assert max_new_tokens(16, 0, 4093, limit) == 4
    assert max_new_tokens(16, 100, 10, limit) == 16
    assert max_new_tokens(16, 0, 4096, None) == 16


def test_the_wire_limit_admits_every_request_inside_the_bounds() -> None:
    cfg = AdmissionConfig()
    assert request_bytes(cfg) > 2 * cfg.max_prompt_bytes + 5 * cfg.max_prompt_tokens
    assert request_bytes(cfg) < 10_000_000


def test_session_limit_codes_on_the_replicas() -> None:
    limit = SessionLimit(context=100, kv_tokens=50)
    limit.check("s", 10, 30, 10)
    with pytest.raises(KVBudgetExceeded, match="KV budget can ever hold"):
        limit.check("s", 10, 30, 11)
    with pytest.raises(InvalidArgument, match="context of 100 tokens"):
        limit.check("s", 0, 101)


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="max_stop_bytes"):
        AdmissionConfig(max_stop_bytes=0)
    with pytest.raises(ValueError, match="max_prompt_tokens must be <="):
        AdmissionConfig(max_prompt_tokens=1 << 20)
