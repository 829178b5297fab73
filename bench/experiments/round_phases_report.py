"""The report of :mod:`bench.experiments.round_phases`: per-phase figures, markdown, the waterfall.

:func:`summary` reduces the analysed requests to per-phase medians, means and shares
(prefill and decode rounds apart) and the requests' totals; :func:`markdown` renders
that as ``bench/results/round_phases.md``; :func:`waterfall` draws one request's
spans as swimlanes and one decode round span by span (``trace_waterfall.png``).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench.common import environment_md, reproduce_command
from bench.round_phases_spans import PHASES, RequestResult, Tree
from specserve.telemetry.receiver import ReceivedSpan


def summary(results: list[RequestResult]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, pick in (("prefill", True), ("decode", False)):
        rounds = [r for res in results for r in res.rounds if r.prefill is pick]
        if not rounds:
            continue
        total = sum(r.total_s for r in rounds)
        out[kind] = {
            "rounds": len(rounds),
            "round_ms_median": statistics.median(r.total_s for r in rounds) * 1e3,
            "phases": {
                p: {
                    "ms_median": statistics.median(r.phases[p] for r in rounds) * 1e3,
                    "ms_mean": sum(r.phases[p] for r in rounds) / len(rounds) * 1e3,
                    "share": sum(r.phases[p] for r in rounds) / total if total else 0.0,
                }
                for p in PHASES
            },
        }
    decode = [r for res in results for r in res.rounds if not r.prefill]
    drafted = sum(r.drafted for res in results for r in res.rounds)
    accepted = sum(r.accepted for res in results for r in res.rounds)
    n_rounds = sum(len(res.rounds) for res in results)
    tokens = sum(res.tokens for res in results)
    seconds = sum(res.seconds for res in results)
    out["requests"] = {
        "count": len(results),
        "tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "ttft_ms_median": statistics.median(r.ttft_s for r in results) * 1e3,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1 + accepted / n_rounds if n_rounds else 0.0,
        "decode_rounds": len(decode),
        "decode_rounds_without_drafts": sum(r.drafted == 0 for r in decode),
    }
    return out


def markdown(data: dict[str, Any], env: dict[str, Any], args: argparse.Namespace) -> str:
    s, r = data["summary"], data["summary"]["requests"]
    lines = [
        "# Where a round's time goes (spans of the full stack)",
        "",
        f"Target `{args.target}` ({args.dtype}), draft `{args.draft}` ({args.draft_dtype}), "
        f"k = {args.k}, greedy, {args.new_tokens} new tokens per request, "
        f"{r['count']} requests one after another (prompts {args.prompts}); target, draft and "
        f"orchestrator are separate processes on loopback with {args.threads} torch "
        "thread(s) each, embedded session store. Every figure is read from the spans "
        "the three processes exported (OpenTelemetry, OTLP/gRPC to a receiver in the "
        "benchmark process).",
        "",
        f"- {r['tokens_per_s']:.2f} tokens/s end to end; time to first token "
        f"{r['ttft_ms_median']:.0f} ms (median); acceptance {100 * r['acceptance_rate']:.1f}%; "
        f"mean acceptance length {r['mean_acceptance_length']:.2f}; "
        f"{r['decode_rounds_without_drafts']} of {r['decode_rounds']} decode rounds went on "
        "without drafts (the draft past its deadline, or none usable)",
        "",
        "| phase | "
        + " | ".join(f"{k} median ms | {k} share" for k in ("prefill", "decode") if k in s)
        + " |",
        "| --- | " + " | ".join("---: | ---:" for k in ("prefill", "decode") if k in s) + " |",
    ]
    for p in PHASES:
        cells = [
            f"{s[k]['phases'][p]['ms_median']:.2f} | {100 * s[k]['phases'][p]['share']:.1f}%"
            for k in ("prefill", "decode")
            if k in s
        ]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    cells = [f"**{s[k]['round_ms_median']:.2f}** | 100%" for k in ("prefill", "decode") if k in s]
    lines.append("| **round** | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Shares are of the summed round time (so they add up to 100%); medians are per "
        "round (so they need not add up to the median round). Transport = the "
        "orchestrator's client span minus the replica's server span; server = the server "
        "span minus the model-thread span (batching window, queue, (de)serialisation); "
        "store = the commit phase plus, on a request's last round, ending the session.",
        "",
        "![waterfall of one request](trace_waterfall.png)",
        "",
        "## Environment",
        "",
        environment_md(env),
        "",
        "## Reproduce",
        "",
        "```bash",
        reproduce_command("bench.experiments.round_phases"),
        "```",
    ]
    return "\n".join(lines)


LANES = (  # (label, span name prefixes, span kind or None for any, colour)
    ("request", ("text_completion", "chat"), None, "#444444"),
    ("round", ("specserve.prefill", "specserve.round"), None, "#888888"),
    ("propose (orchestrator)", ("specserve.propose",), None, "#9ecae1"),
    ("Propose RPC (draft server)", ("/specserve.v1.DraftService/Propose",), "server", "#4292c6"),
    ("draft forward", ("specserve.draft.propose",), None, "#08306b"),
    ("verify (orchestrator)", ("specserve.verify",), None, "#fdae6b"),
    ("Verify RPC (target server)", ("/specserve.v1.TargetService/Verify",), "server", "#f16913"),
    ("target forward", ("specserve.target.verify",), None, "#7f2704"),
    ("commit + Redis", ("specserve.commit", "specserve.finish"), None, "#41ab5d"),
)


def waterfall(spans: list[ReceivedSpan], path: Path, title: str) -> None:
    """Swimlanes of one whole request (top) and one decode round span by span (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tree = Tree(spans)
    root = tree.root()
    t0 = root.start_ns
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(13, 11), gridspec_kw={"height_ratios": [1, 1.6]}
    )
    for row, (_, names, kind, colour) in enumerate(LANES):
        segs = [
            ((s.start_ns - t0) / 1e6, (s.end_ns - s.start_ns) / 1e6)
            for s in spans
            if s.name.startswith(names) and kind in (None, s.kind)
        ]
        top.broken_barh(segs, (row - 0.4, 0.8), color=colour, edgecolor="white", linewidth=0.4)
    top.set_yticks(range(len(LANES)), [lane[0] for lane in LANES])
    top.invert_yaxis()
    top.set_xlabel("ms since the request arrived")
    top.set_title(f"{title}: every span of one request, by kind")

    rounds = [s for s in spans if s.name == "specserve.round"]
    rnd = rounds[len(rounds) // 2] if rounds else root
    rows: list[tuple[ReceivedSpan, int]] = []

    def walk(span: ReceivedSpan, depth: int) -> None:
        rows.append((span, depth))
        for kid in tree.children(span):
            walk(kid, depth + 1)

    walk(rnd, 0)
    r0 = rnd.start_ns
    colours = {"specserve-orchestrator": "#6baed6", "specserve-draft": "#2171b5"}
    for i, (s, _) in enumerate(rows):
        colour = colours.get(s.service, "#e6550d")
        if s.kind == "client" and s.name.startswith("/"):
            colour = "#bdbdbd"
        elif s.kind == "client":
            colour = "#41ab5d"  # Redis
        start, width = (s.start_ns - r0) / 1e6, (s.end_ns - s.start_ns) / 1e6
        bottom.barh(i, width, left=start, color=colour, height=0.7)
        bottom.text(start + width, i, f" {width:.2f} ms", va="center", fontsize=7, color="#333333")
    bottom.set_yticks(
        range(len(rows)),
        [f"{'· ' * d}{s.service.removeprefix('specserve-')}: {s.name}" for s, d in rows],
        fontsize=7,
    )
    bottom.invert_yaxis()
    bottom.set_xlabel("ms since the round began")
    bottom.set_title(
        f"one decode round (round {rnd.attributes.get('spec.round_index', '?')}, "
        f"k = {rnd.attributes.get('spec.k', '?')}, accepted "
        f"{rnd.attributes.get('spec.accepted', '?')}), span by span: orchestrator light blue, "
        "draft dark blue, target orange, gRPC client grey, Redis green",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
