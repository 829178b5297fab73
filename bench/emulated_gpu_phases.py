"""Where a round of the stack goes at emulated accelerator speed, read from traced requests.

The stack's processes export spans to a :class:`~specserve.telemetry.receiver.TraceReceiver`
in the benchmark process with a sample ratio of 0 (:func:`traced_environment`), so the
timed requests make no traces; a request that carries a sampled W3C ``traceparent``
of its own is traced whole (the samplers are parent-based), through the orchestrator
and both replicas. :func:`round_phases` sends such requests one at a time and splits
every decode round the way :mod:`bench.experiments.round_phases` does, into five parts:

* **device**: the model-thread spans of the draft and the target (with emulated
  devices: the device time, plus the tiny models' own CPU time);
* **transport**: each client span minus its server span (gRPC, HTTP/2, loopback);
* **servers**: each server span minus its model-thread span (queue, (de)serialisation,
  validation, the hop to the model thread);
* **store**: the commit to the session store (and ending the session), inside the
  round span (a commit that overlaps the next round's Propose is off the path);
* **orchestrator**: the rest of the round span.
"""

from __future__ import annotations

import os
import secrets
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from bench.round_phases_spans import Tree, split_round
from specserve.client import Client
from specserve.telemetry.attributes import SPAN_COMMIT, SPAN_FINISH, SPAN_ROUND
from specserve.telemetry.receiver import ReceivedSpan, TraceReceiver

PARTS = {
    "device": ("draft compute", "verify compute"),
    "transport": ("draft transport", "verify transport"),
    "servers": ("draft server", "target server"),
    "store": ("store",),
    "orchestrator": ("orchestrator",),
}


@contextmanager
def traced_environment(receiver: TraceReceiver) -> Iterator[None]:
    """While inside, processes started from here export spans to ``receiver`` and trace
    only requests whose caller sent a sampled trace context."""
    settings = {**receiver.env(), "OTEL_TRACES_SAMPLER_ARG": "0"}
    before = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def request_spans(receiver: TraceReceiver, trace_id: str) -> list[ReceivedSpan]:
    """The spans of one finished request, once its request span has come in."""

    def has_request(spans: list[ReceivedSpan]) -> bool:
        return any(
            s.trace_id == trace_id and "gen_ai.operation.name" in s.attributes for s in spans
        )

    receiver.wait_for(has_request, timeout_s=30)
    time.sleep(0.5)  # the replicas' last spans follow within the export delay
    return [s for s in receiver.spans() if s.trace_id == trace_id]


def _inside_s(span: ReceivedSpan, outer: ReceivedSpan) -> float:
    """Seconds of ``span`` that fall inside ``outer``."""
    overlap = min(span.end_ns, outer.end_ns) - max(span.start_ns, outer.start_ns)
    return max(0, overlap) / 1e9


def decode_rounds(spans: list[ReceivedSpan]) -> list[dict[str, float]]:
    """Each decode round of the request in ``spans``: seconds by part, and ``round``.

    The store part is the commit's (and ending's) time inside the round span: a commit
    that runs on while the next round proposes is off this round's path for the rest.
    The orchestrator part is what the other parts leave of the round span."""
    tree = Tree(spans)
    out = []
    for span in spans:
        if span.name != SPAN_ROUND:
            continue
        split = split_round(tree, span)
        phases = dict(split.phases)
        phases["store"] = sum(
            _inside_s(s, span)
            for name in (SPAN_COMMIT, SPAN_FINISH)
            for s in tree.children(span, name)
        )
        phases["orchestrator"] = split.total_s - sum(
            v for k, v in phases.items() if k != "orchestrator"
        )
        parts = {p: sum(phases[x] for x in names) for p, names in PARTS.items()}
        out.append({**parts, "round": split.total_s})
    return out


def round_phases(
    address: str,
    receiver: TraceReceiver,
    prompts: Sequence[list[int]],
    new_tokens: int,
    drafter: str,
) -> dict[str, Any]:
    """One traced request per prompt, one at a time (greedy, EOS ignored): mean ms per
    decode round of each part, and the round itself, over every decode round."""
    rounds: list[dict[str, float]] = []
    with Client(address, timeout_s=600) as client:
        for prompt in prompts:
            trace_id = secrets.token_hex(16)
            client.metadata = (("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),)
            client.generate(prompt, max_new_tokens=new_tokens, drafter=drafter, ignore_eos=True)
            rounds += decode_rounds(request_spans(receiver, trace_id))
    if not rounds:
        return {"rounds": 0, "ms_per_round": {}}
    keys = [*PARTS, "round"]
    return {
        "rounds": len(rounds),
        "ms_per_round": {k: 1e3 * statistics.fmean(r[k] for r in rounds) for k in keys},
        "round_ms_median": 1e3 * statistics.median(r["round"] for r in rounds),
    }
