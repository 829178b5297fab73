"""Property-based fuzz of the public request against a live stack (issue 24).

Hypothesis draws every field of ``GenerateRequest`` — the prompt (text, token ids or
chat, including empty, huge, out-of-vocabulary and non-UTF-8-looking values), every
sampling parameter (NaN, infinities, negatives, extremes), the stop strings, the
drafter and k, the session id and keep_session — and sends it to Generate or
GenerateStream on a stack of real processes. Properties:

* every answer is OK or one of the documented refusals (INVALID_ARGUMENT, NOT_FOUND,
  FAILED_PRECONDITION, RESOURCE_EXHAUSTED) with a sentence, never INTERNAL or UNKNOWN;
* every process stays SERVING;
* afterwards no Redis key and no KV allocation is left on any replica (kept
  sessions are closed by the test, as a client would).

The case count is printed (``-s``). ``SPECSERVE_FUZZ_EXAMPLES`` raises it.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.v1 import generate_pb2, generate_pb2_grpc
from tests.orchestrator.stack import Stack, kv_used, redis_keys

pytestmark = pytest.mark.redis

EXAMPLES = int(os.environ.get("SPECSERVE_FUZZ_EXAMPLES", "80"))
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def utf8(text: str) -> str:
    """``text`` as proto3 strings must be: valid UTF-8 (lone surrogates replaced)."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


WILD_FLOATS = st.one_of(
    st.sampled_from([-1.0, float("nan"), float("inf"), -float("inf"), 1e38, 2.0]),
    st.floats(width=32),
)
TEXTS = st.one_of(st.text(max_size=60), st.sampled_from(["", "\x00", "\ud800", "é" * 3000]))
# field -> (a value a client would send, anything at all); a case makes 0-2 fields wild.
FIELDS = {
    "prompt": (
        st.lists(st.integers(0, 255), min_size=1, max_size=20).map(lambda t: ("ids", t)),
        st.one_of(
            st.lists(st.integers(-2, 300), max_size=40).map(lambda t: ("ids", t)),
            st.sampled_from([[7] * 5000, [7] * 131_073, [1] * 4096]).map(lambda t: ("ids", t)),
            TEXTS.map(lambda t: ("text", t)),
            st.lists(
                st.tuples(st.sampled_from(["system", "user", "assistant", "", "robot"]), TEXTS),
                max_size=4,
            ).map(lambda m: ("chat", m)),
            st.just(("none", None)),
        ),
    ),
    "temperature": (st.sampled_from([0.0, 0.7]), WILD_FLOATS),
    "top_p": (st.sampled_from([0.0, 0.9, 1.0]), WILD_FLOATS),
    "top_k": (st.sampled_from([0, 5]), st.sampled_from([-1, -(2**31), 2**31 - 1, 300])),
    "seed": (st.none() | st.integers(0, 2**20), st.integers(0, 2**64 - 1)),
    "max_new_tokens": (st.integers(0, 12), st.sampled_from([8193, 2**32 - 1])),
    "stop": (
        st.lists(st.sampled_from([" 17", " 3 4", "x"]), max_size=2),
        st.lists(
            st.one_of(st.text(max_size=8), st.sampled_from(["x" * 1025, "y" * 1000])),
            max_size=18,
        ),
    ),
    "rule": (st.sampled_from([0, 1, 2]), st.sampled_from([3, -1, 2**31 - 1])),
    "ignore_eos": (st.booleans(), st.booleans()),
    "logprobs": (st.none() | st.integers(0, 5), st.sampled_from([21, 1000, 2**32 - 1])),
    "drafter": (st.sampled_from([0, 1, 2, 3]), st.sampled_from([4, -1, 2**31 - 1])),
    "k": (st.none() | st.integers(0, 8), st.sampled_from([16, 17, 2**32 - 1])),
    "session_id": (
        st.just(""),
        st.one_of(st.text(max_size=10), st.sampled_from(["no-such-session", "x" * 129])),
    ),
}


@st.composite
def requests(draw: st.DrawFn, kept: list[str]) -> tuple[generate_pb2.GenerateRequest, bool]:
    """A request with 0-2 wild fields; (the request, whether to stream it)."""
    wild = draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=2))
    v = {name: draw(pair[name in wild]) for name, pair in FIELDS.items()}
    req = generate_pb2.GenerateRequest()
    kind, prompt = v["prompt"]
    if kind == "ids":
        req.token_ids.ids.extend(prompt)
    elif kind == "text":
        req.text = utf8(prompt)
    elif kind == "chat":
        req.chat.SetInParent()
        for role, content in prompt:
            req.chat.messages.add(role=role, content=utf8(content))
    s = req.sampling
    s.temperature, s.top_p, s.top_k = v["temperature"], v["top_p"], v["top_k"]
    if v["seed"] is not None:
        s.seed = v["seed"]
    s.max_new_tokens = v["max_new_tokens"]
    s.stop.extend(utf8(t) for t in v["stop"])
    s.rule, s.ignore_eos = v["rule"], v["ignore_eos"]
    if v["logprobs"] is not None:
        s.logprobs = v["logprobs"]
    req.speculation.drafter = v["drafter"]
    if v["k"] is not None:
        req.speculation.k = v["k"]
    req.session_id = utf8(v["session_id"])
    reuse, pick = draw(st.booleans()), draw(st.integers(0, 1 << 16))  # drawn either way
    if kept and reuse and "session_id" not in wild:
        req.session_id = kept[pick % len(kept)]  # continue a kept session
    req.keep_session = draw(st.booleans())
    return req, draw(st.booleans())


def test_fuzz_every_field_of_the_public_request(stack: Stack) -> None:
    keys_before = set(redis_keys(stack.redis_url))
    codes: Counter[str] = Counter()
    kept: list[str] = []
    with grpc.insecure_channel(stack.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(st.data())
        def case(data: st.DataObject) -> None:
            req, streaming = data.draw(requests(kept))
            code, details, sid = grpc.StatusCode.OK, "", ""
            try:
                if streaming:
                    sid = [m.session_id for m in stub.GenerateStream(req, timeout=60)][-1]
                else:
                    sid = stub.Generate(req, timeout=60).session_id
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
            codes[code.name] += 1
            assert code in DOCUMENTED, (code, details, req)
            if code != grpc.StatusCode.OK:
                assert len(details) > 10 and "Traceback" not in details, (code, details)
                assert "internal error" not in details, details
            elif req.keep_session and sid not in kept:
                kept.append(sid)

        case()
        for sid in kept:  # a client's duty: close what it kept (a later turn may have ended it)
            try:
                stub.CloseSession(generate_pb2.CloseSessionRequest(session_id=sid), timeout=10)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.NOT_FOUND, e
    total = sum(codes.values())
    print(f"fuzz: {total} cases against a live stack: {dict(codes)}")
    assert total >= EXAMPLES
    assert codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0
    for proc in [*stack.target_procs, stack.draft, stack.orchestrator]:
        assert proc is not None and proc.health() == health_pb2.HealthCheckResponse.SERVING
    assert stack.draft is not None
    deadline = time.monotonic() + 15
    while True:
        leaks = (
            set(redis_keys(stack.redis_url)) - keys_before,
            kv_used(stack.target_procs[0].address, "target"),
            kv_used(stack.draft.address, "draft"),
        )
        if leaks == (set(), (0, 0), (0, 0)):
            break
        assert time.monotonic() < deadline, f"left behind (keys, target kv, draft kv): {leaks}"
        time.sleep(0.1)
