"""bench.experiments.round_phases' own code on a hand-built trace (no processes, no weights).

A full run starts three servers; here the spans they would export are built by hand,
with the names and attributes the stack gives them, and go through what ``main`` does
with them: find the request's trace by its session, split every round into phases,
summarise, render the markdown and draw the waterfall. ``main`` itself runs with the
stack, the client and the span receiver stood in for; the tiny prompts and the
command line are checked too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.common import environment
from bench.experiments import round_phases
from bench.experiments.round_phases_report import markdown, summary
from bench.round_phases_spans import PHASES, analyse
from specserve.telemetry.receiver import ReceivedSpan

MS = 1_000_000  # ns
TRACE = "a" * 32
SESSION = "session-1"
DRAFT = "/specserve.v1.DraftService/Propose"
VERIFY = "/specserve.v1.TargetService/Verify"
DRAFT_FORWARD = "specserve.draft.propose"
DRAFT_SERVER = "specserve-draft"
# One round's phases as the spans below make them (ms): Propose 0-5 (server 1-4,
# forward 1-3), Verify 6-22 (server 7-21, forward 8-20), commit 24-28 of 30.
ROUND_MS = {
    "draft compute": 2,
    "draft server": 1,
    "draft transport": 2,
    "verify compute": 12,
    "target server": 2,
    "verify transport": 2,
    "store": 4,
    "orchestrator": 5,
}


def span(
    sid: str,
    parent: str,
    name: str,
    start: int,
    end: int,
    kind: str = "internal",
    service: str = "specserve-orchestrator",
    **attributes: Any,
) -> ReceivedSpan:
    resource = {"service.name": service}
    return ReceivedSpan(TRACE, sid, parent, name, kind, start * MS, end * MS, attributes, resource)


def round_spans(
    rid: str, t: int, name: str, drafted: int, accepted: int, finish: bool = False
) -> list[ReceivedSpan]:
    """One 30 ms round from ``t`` ms with the phases of :data:`ROUND_MS`; ``finish``: the
    request's last round, which ends the session in its last millisecond."""
    attrs = {"spec.drafted": drafted, "spec.accepted": accepted, "spec.k": 4}
    out = [
        span(rid, "req", name, t, t + 30, **attrs, **{"spec.round_index": int(rid[1:])}),
        span(f"{rid}p", rid, "specserve.propose", t, t + 5),
        span(f"{rid}pc", f"{rid}p", DRAFT, t, t + 5, "client"),
        span(f"{rid}ps", f"{rid}pc", DRAFT, t + 1, t + 4, "server", DRAFT_SERVER),
        span(f"{rid}pf", f"{rid}ps", DRAFT_FORWARD, t + 1, t + 3, "internal", DRAFT_SERVER),
        span(f"{rid}v", rid, "specserve.verify", t + 6, t + 22),
        span(f"{rid}vc", f"{rid}v", VERIFY, t + 6, t + 22, "client"),
        span(f"{rid}vs", f"{rid}vc", VERIFY, t + 7, t + 21, "server", "specserve-target"),
        span(f"{rid}vf", f"{rid}vs", "specserve.target.verify", t + 8, t + 20),
        span(f"{rid}c", rid, "specserve.commit", t + 24, t + 28),
    ]
    if finish:
        out.append(span(f"{rid}f", rid, "specserve.finish", t + 29, t + 30))
    return out


def trace() -> list[ReceivedSpan]:
    request = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.conversation.id": SESSION,
        "gen_ai.response.time_to_first_chunk": 0.04,
        "gen_ai.usage.output_tokens": 12,
    }
    return [
        span("root", "", "/specserve.v1.Generation/Generate", 0, 200, "server"),
        span("req", "root", "text_completion tiny", 1, 199, **request),
        *round_spans("r0", 10, "specserve.prefill", 0, 0),
        *round_spans("r1", 50, "specserve.round", 4, 3),
        *round_spans("r2", 90, "specserve.round", 4, 1, finish=True),
    ]


class Receiver:
    """A TraceReceiver whose spans are all in: the one request's trace."""

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def spans(self) -> list[ReceivedSpan]:
        return trace()

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float
    ) -> list[ReceivedSpan]:
        assert done(self.spans()), "the benchmark waits for spans that never come"
        return self.spans()


class Stack:
    """Stands in for the three server processes and the client of the orchestrator."""

    def __init__(self) -> None:
        self.address = "127.0.0.1:1"
        self.stopped = 0
        self.requests: list[tuple[list[int], int, int]] = []

    def stop(self) -> None:
        self.stopped += 1

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def generate(self, prompt: list[int], max_new_tokens: int, k: int) -> SimpleNamespace:
        self.requests.append((prompt, max_new_tokens, k))
        return SimpleNamespace(session_id=SESSION, usage=SimpleNamespace(acceptance_rate=0.5))


def test_the_command_line_and_the_tiny_prompts() -> None:
    args = round_phases.parser().parse_args([])
    assert (args.target, args.draft, args.k) == (round_phases.TARGET, round_phases.DRAFT, 4)
    assert (args.prompts, args.requests, args.no_write) == ("0-9", None, False)
    first, second = round_phases.prompts("tiny:3", [0, 1])
    assert len(first) == len(second) == 32 and first != second
    assert round_phases.prompts("tiny:3", [0]) == [first]  # seeded by the prompt's index


def test_a_trace_is_split_summarised_and_rendered() -> None:
    spans = trace()
    result = analyse(TRACE, spans)
    assert (result.seconds, result.ttft_s, result.tokens) == (pytest.approx(0.198), 0.04, 12)
    assert [r.prefill for r in result.rounds] == [True, False, False]
    for rnd in result.rounds:
        last = rnd is result.rounds[-1]
        want = {**ROUND_MS, "store": 5, "orchestrator": 4} if last else ROUND_MS
        assert rnd.phases == {p: pytest.approx(want[p] / 1e3) for p in PHASES}
        assert sum(rnd.phases.values()) == pytest.approx(rnd.total_s)

    s = summary([result])
    assert (s["prefill"]["rounds"], s["decode"]["rounds"]) == (1, 2)
    assert s["decode"]["round_ms_median"] == pytest.approx(30.0)
    assert s["decode"]["phases"]["verify compute"]["share"] == pytest.approx(24 / 60)
    assert sum(p["share"] for p in s["decode"]["phases"].values()) == pytest.approx(1.0)
    r = s["requests"]
    assert (r["count"], r["tokens"], r["decode_rounds"]) == (1, 12, 2)
    assert r["acceptance_rate"] == pytest.approx(4 / 8)
    assert r["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)

    args = round_phases.parser().parse_args(["--target", "tiny:3", "--new-tokens", "12"])
    md = markdown({"summary": s}, environment(), args)
    assert md.startswith("# Where a round's time goes (spans of the full stack)")
    assert "| phase | prefill median ms | prefill share | decode median ms | decode share |" in md
    assert "| verify compute | 12.00 | 40.0% | 12.00 | 40.0% |" in md
    assert "| **round** | **30.00** | 100% | **30.00** | 100% |" in md
    assert "acceptance 50.0%" in md and "![waterfall of one request]" in md


def test_main_runs_its_requests_and_draws_the_waterfall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = Stack()
    monkeypatch.setattr(round_phases, "TraceReceiver", Receiver)
    monkeypatch.setattr(round_phases, "start_stack", lambda args, receiver: [stack] * 3)
    monkeypatch.setattr(round_phases, "Client", lambda address, timeout_s: stack)
    monkeypatch.setattr(round_phases, "write_results", None)  # --no-write: never called
    png = tmp_path / "waterfall.png"
    argv = ["--target", "tiny:3", "--draft", "tiny:3:noise=0.3", "--prompts", "0-1"]
    argv += ["--new-tokens", "12", "--no-write", "--waterfall", str(png)]
    assert round_phases.main(argv) == 0
    assert stack.stopped == 3  # every process stopped
    prompts = round_phases.prompts("tiny:3", [0, 1])
    assert stack.requests == [(prompts[0][:16], 8, 4), (prompts[0], 12, 4), (prompts[1], 12, 4)]
    out = capsys.readouterr().out
    assert "request 1: 12 tokens in 0.20 s, 3 rounds, acceptance 50%" in out
    assert "| **round** | **30.00** | 100% | **30.00** | 100% |" in out
    assert f"waterfall: {png}" in out and png.stat().st_size > 0
