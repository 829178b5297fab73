"""The span arithmetic of :mod:`bench.experiments.round_phases`: a request's trace split by phase.

:class:`Tree` indexes the spans of one trace by id and by parent; :func:`split_round`
splits one round span into :data:`PHASES` (compute, server and transport of the
draft's Propose and the target's Verify, the store, the orchestrator's own rest);
:func:`analyse` does it for every round of one request. :mod:`bench.emulated_gpu_phases`
and :mod:`bench.experiments.forwarding_hop` read their traces with the same :class:`Tree`.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from specserve.telemetry.receiver import ReceivedSpan

PHASES = (
    "draft compute",
    "draft server",
    "draft transport",
    "verify compute",
    "target server",
    "verify transport",
    "store",
    "orchestrator",
)


# A round's phase span, the RPC under it, the forward's span on the model thread, and
# the PHASES its compute, server and transport parts go to.
_CALLS = (
    (
        "specserve.propose",
        "/specserve.v1.DraftService/Propose",
        "specserve.draft.propose",
        ("draft compute", "draft server", "draft transport"),
    ),
    (
        "specserve.verify",
        "/specserve.v1.TargetService/Verify",
        "specserve.target.verify",
        ("verify compute", "target server", "verify transport"),
    ),
)


class Tree:
    """The spans of one trace, by id and by parent."""

    def __init__(self, spans: list[ReceivedSpan]) -> None:
        self.spans = spans
        self.by_id = {s.span_id: s for s in spans}
        self.kids: dict[str, list[ReceivedSpan]] = collections.defaultdict(list)
        for s in spans:
            self.kids[s.parent_id].append(s)
        for kids in self.kids.values():
            kids.sort(key=lambda s: s.start_ns)

    def children(self, span: ReceivedSpan, name: str | None = None) -> list[ReceivedSpan]:
        return [s for s in self.kids[span.span_id] if name is None or s.name == name]

    def root(self) -> ReceivedSpan:
        [root] = [s for s in self.spans if not s.parent_id]
        return root


def rpc_split(tree: Tree, phase: ReceivedSpan, method: str, forward: str) -> tuple[float, ...]:
    """(compute, server, transport) seconds of the RPCs made in a phase (summed)."""
    compute = server = transport = 0.0
    for client in tree.children(phase, method):
        for srv in tree.children(client, method):
            # Only the forward time inside the server span: a call past its deadline
            # (the draft's, typically) ends while its forward still runs.
            fwd = sum(
                max(0, min(f.end_ns, srv.end_ns) - max(f.start_ns, srv.start_ns)) / 1e9
                for f in tree.children(srv, forward)
            )
            compute += fwd
            server += srv.duration_s - fwd
            transport += client.duration_s - srv.duration_s
    return compute, server, transport


@dataclass
class RoundSplit:
    prefill: bool
    total_s: float
    phases: dict[str, float]
    drafted: int
    accepted: int


def split_round(tree: Tree, rnd: ReceivedSpan) -> RoundSplit:
    phases = dict.fromkeys(PHASES, 0.0)
    for phase, method, forward, parts in _CALLS:
        for span in tree.children(rnd, phase):
            for part, seconds in zip(parts, rpc_split(tree, span, method, forward), strict=True):
                phases[part] += seconds
    for name in ("specserve.commit", "specserve.finish"):
        phases["store"] += sum(s.duration_s for s in tree.children(rnd, name))
    phases["orchestrator"] = rnd.duration_s - sum(phases.values())
    return RoundSplit(
        rnd.name == "specserve.prefill",
        rnd.duration_s,
        phases,
        int(rnd.attributes.get("spec.drafted", 0)),
        int(rnd.attributes.get("spec.accepted", 0)),
    )


@dataclass
class RequestResult:
    trace_id: str
    seconds: float
    ttft_s: float
    tokens: int
    rounds: list[RoundSplit] = field(default_factory=list)


def analyse(trace_id: str, spans: list[ReceivedSpan]) -> RequestResult:
    tree = Tree(spans)
    root = tree.root()
    [request] = [s for s in tree.children(root) if "gen_ai.operation.name" in s.attributes]
    rounds = [
        split_round(tree, s)
        for s in tree.children(request)
        if s.name in ("specserve.prefill", "specserve.round")
    ]
    return RequestResult(
        trace_id,
        request.duration_s,
        float(request.attributes.get("gen_ai.response.time_to_first_chunk", 0.0)),
        int(request.attributes.get("gen_ai.usage.output_tokens", 0)),
        rounds,
    )
