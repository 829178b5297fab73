"""One Generate call over three real processes is one trace; /metrics moves with its usage.

The servers export to an OTLP/gRPC receiver this test runs. The trace must hold,
with correct parent links: the orchestrator's gRPC server span -> the GenAI request
span -> a prefill span and a round span per later round -> propose / verify /
commit phases -> the orchestrator's gRPC client spans (and Redis spans) -> the
draft's and target's gRPC server spans -> the forward span on each model thread.
Propose and Verify travel on the replicas' data-plane sockets, each call with its own
trace context in the message; the spans are the unary calls' all the same.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterator

import pytest

from specserve.client import Client
from specserve.orchestrator.launch import OrchestratorProcess
from specserve.telemetry.receiver import ReceivedSpan
from tests.orchestrator.stack import ENV
from tests.telemetry.stack import DRAFT, MODEL_NAME, TARGET, TracedStack

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]


@pytest.fixture(scope="module")
def traced() -> Iterator[TracedStack]:
    stack = TracedStack()
    try:
        yield stack.start()
    finally:
        stack.stop()


def one_child(parent: ReceivedSpan, spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.parent_id == parent.span_id and s.name == name]
    assert len(found) == 1, (
        parent.name,
        name,
        [s.name for s in spans if s.parent_id == parent.span_id],
    )
    return found[0]


def test_one_generate_is_one_trace_across_the_three_services(traced: TracedStack) -> None:
    traced.receiver.clear()
    with Client(traced.address, timeout_s=60) as c:
        out = c.generate(PROMPT, max_new_tokens=24, k=3, temperature=0.0)
    usage = out.usage
    assert usage.drafted_tokens > 0 and usage.accepted_tokens > 0  # speculation happened

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = collections.Counter(s.name for s in spans)
        return (
            names["/specserve.v1.Generation/Generate"] == 1
            and names["specserve.draft.propose"] >= usage.rounds
            and names["specserve.target.verify"] >= usage.rounds
            and names["/specserve.v1.TargetService/Release"] == 2  # client and server
        )

    spans = traced.receiver.wait_for(complete, timeout_s=20)
    assert len({s.trace_id for s in spans}) == 1, "everything belongs to the one request"
    by_id = {s.span_id: s for s in spans}
    assert all(s.parent_id in by_id for s in spans if s.parent_id), "no dangling parent"

    [root] = [s for s in spans if not s.parent_id]
    assert (root.name, root.kind, root.service) == (
        "/specserve.v1.Generation/Generate",
        "server",
        "specserve-orchestrator",
    )
    assert root.resource["specserve.pool"] == "orchestrator"
    request = one_child(root, spans, f"text_completion {MODEL_NAME}")
    a = request.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == MODEL_NAME
    assert a["gen_ai.request.max_tokens"] == 24
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens == len(PROMPT)
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens == 24
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.conversation.id"] == out.session_id
    assert (a["spec.rounds"], a["spec.drafted"], a["spec.accepted"]) == (
        usage.rounds,
        usage.drafted_tokens,
        usage.accepted_tokens,
    )
    # The turn's record is written to the store inside the request span.
    assert any(s.name == "EVALSHA" for s in spans if s.parent_id == request.span_id)

    rounds = sorted(
        (s for s in spans if s.parent_id == request.span_id and s.name.startswith("specserve.")),
        key=lambda s: s.start_ns,
    )
    assert [s.name for s in rounds] == ["specserve.prefill"] + ["specserve.round"] * (
        usage.rounds - 1
    )
    assert rounds[0].attributes["specserve.prefill_tokens"] == len(PROMPT)
    assert [s.attributes["spec.round_index"] for s in rounds] == list(range(usage.rounds))
    assert sum(s.attributes["spec.drafted"] for s in rounds) == usage.drafted_tokens
    assert sum(s.attributes["spec.accepted"] for s in rounds) == usage.accepted_tokens
    assert all(s.attributes["spec.k"] >= s.attributes["spec.drafted"] for s in rounds)

    for rnd in rounds:
        propose = one_child(rnd, spans, "specserve.propose")
        verify = one_child(rnd, spans, "specserve.verify")
        commit = one_child(rnd, spans, "specserve.commit")
        assert propose.end_ns <= verify.start_ns <= verify.end_ns <= commit.start_ns
        assert verify.attributes["spec.accepted"] == rnd.attributes["spec.accepted"]
        assert verify.attributes["specserve.batch_size"] == 1
        assert any(s.name == "EVALSHA" for s in spans if s.parent_id == commit.span_id)
        for phase, service, method, forward, pool, model in (
            (propose, "DraftService", "Propose", "specserve.draft.propose", "draft", DRAFT),
            (verify, "TargetService", "Verify", "specserve.target.verify", "target", TARGET),
        ):
            client = one_child(phase, spans, f"/specserve.v1.{service}/{method}")
            assert client.kind == "client" and client.service == "specserve-orchestrator"
            server = one_child(client, spans, f"/specserve.v1.{service}/{method}")
            assert server.kind == "server" and server.service == f"specserve-{pool}"
            # The orchestrator's default data plane: a call on the replica's socket,
            # parented by the context the message carried.
            assert server.attributes["specserve.transport"] == "socket"
            assert server.resource["specserve.pool"] == pool
            assert server.resource["specserve.model"] == model
            assert client.start_ns <= server.start_ns and server.end_ns <= client.end_ns
            assert server.attributes["specserve.queue_wait_s"] >= 0
            assert server.attributes["specserve.batch_size"] == 1
            fwd = one_child(server, spans, forward)
            assert fwd.service == f"specserve-{pool}"
            assert server.start_ns <= fwd.start_ns and fwd.end_ns <= server.end_ns
            assert fwd.attributes["specserve.batch_size"] == 1
        target_server = one_child(
            one_child(verify, spans, "/specserve.v1.TargetService/Verify"),
            spans,
            "/specserve.v1.TargetService/Verify",
        )
        assert target_server.attributes["spec.accepted"] == rnd.attributes["spec.accepted"]


def test_metrics_move_with_the_request_usage(traced: TracedStack) -> None:
    before = {role: traced.scrape(role) for role in ("orchestrator", "draft", "target")}
    with Client(traced.address, timeout_s=60) as c:
        usage = c.generate(PROMPT, max_new_tokens=20, k=4).usage
    after = {role: traced.scrape(role) for role in ("orchestrator", "draft", "target")}

    def delta(role: str, name: str) -> float:
        return after[role].get(name, 0.0) - before[role].get(name, 0.0)

    o = "specserve_orchestrator_"
    assert usage.drafted_tokens > 0 and usage.accepted_tokens > 0
    assert delta("orchestrator", f"{o}prompt_tokens_total") == usage.prompt_tokens
    assert delta("orchestrator", f"{o}completion_tokens_total") == usage.completion_tokens == 20
    assert delta("orchestrator", f"{o}session_rounds_total") == usage.rounds
    assert delta("orchestrator", f"{o}draft_tokens_total") == usage.drafted_tokens
    assert delta("orchestrator", f"{o}accepted_tokens_total") == usage.accepted_tokens
    accepted_by_position = sum(
        delta("orchestrator", k)
        for k in after["orchestrator"]
        if "accepted_tokens_by_position" in k
    )
    assert accepted_by_position == usage.accepted_tokens
    first_position = f'{o}draft_tokens_by_position_total{{position="1"}}'
    assert delta("orchestrator", first_position) == usage.rounds  # every round drafted (k = 4)
    assert delta("orchestrator", f'{o}requests_total{{finish_reason="length"}}') == 1
    for hist in ("time_to_first_token_seconds", "request_duration_seconds"):
        assert delta("orchestrator", f"{o}{hist}_count") == 1
    assert delta("orchestrator", f"{o}inter_token_latency_seconds_count") >= 1
    assert after["orchestrator"][f"{o}sessions"] == 0
    cumulative = after["orchestrator"]
    assert cumulative[f"{o}acceptance_ratio"] == pytest.approx(
        cumulative[f"{o}accepted_tokens_total"] / cumulative[f"{o}draft_tokens_total"]
    )
    assert cumulative[f"{o}mean_acceptance_length"] == pytest.approx(
        1 + cumulative[f"{o}accepted_tokens_total"] / cumulative[f"{o}session_rounds_total"]
    )
    # The replicas count the same round from their side.
    assert delta("draft", "specserve_draft_proposals_total") == usage.rounds
    assert delta("draft", "specserve_draft_tokens_total") == usage.drafted_tokens
    assert delta("target", "specserve_target_verified_sessions_total") == usage.rounds
    assert delta("target", "specserve_target_draft_tokens_total") == usage.drafted_tokens
    assert delta("target", "specserve_target_accepted_tokens_total") == usage.accepted_tokens
    assert delta("target", "specserve_target_prefills_total") == 1
    for role, op in (("draft", "propose"), ("target", "verify")):
        p = f"specserve_{role}_"
        assert delta(role, f'{p}batch_sessions_count{{op="{op}"}}') == usage.rounds
        assert delta(role, f'{p}queue_wait_seconds_count{{op="{op}"}}') == usage.rounds
        assert delta(role, f'{p}forward_duration_seconds_sum{{op="{op}"}}') > 0
        assert after[role][f"{p}up"] == 1 and after[role][f"{p}queue_depth"] == 0
        assert after[role][f"{p}kv_cache_free_bytes"] > 0


def test_spans_still_queued_are_exported_at_sigterm(traced: TracedStack) -> None:
    """An orchestrator whose exporter would wait a minute flushes its spans when stopped."""
    env = {**ENV, **traced.receiver.env(), "OTEL_BSP_SCHEDULE_DELAY": "60000"}
    args = ["--target", traced.procs["target"].address, "--draft", traced.procs["draft"].address]
    orchestrator = OrchestratorProcess([*args, "--log-format", "json"], env=env).start()
    try:
        orchestrator.wait_serving()
        with Client(orchestrator.address, timeout_s=60) as c:
            session = c.generate(PROMPT, max_new_tokens=4).session_id

        def requests(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
            return [s for s in spans if s.attributes.get("gen_ai.conversation.id") == session]

        time.sleep(0.5)  # the replicas' spans arrive; the orchestrator's stay queued
        assert requests(traced.receiver.spans()) == []
        assert orchestrator.stop() == 0
        traced.receiver.wait_for(lambda spans: len(requests(spans)) == 1, timeout_s=10)
    finally:
        orchestrator.stop()
    logs = [line for line in orchestrator.output().splitlines() if line.startswith("{")]
    assert logs and all(json.loads(line)["service"] == "specserve-orchestrator" for line in logs)
