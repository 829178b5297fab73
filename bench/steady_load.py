"""Constant concurrency: ``c`` requests in flight, each slot sending its next as its last ends.

A closed batch (``c`` requests sent at once, the clock stopped at the last token) ends
when its slowest stream does. Under speculation streams advance at their own
acceptance, so the batch's wall time is its least predictable session's: with one
session of 32 at an acceptance near 0.4, that session alone, drafting or not, decodes
about as fast as plain decoding would, and the batch cannot beat plain by much however
well the rest draft (:func:`tail_of` measures it). A serving replica does not see
closed batches: as a request ends another starts, which is how load generators drive
one (guidellm's ``concurrent`` profile, vLLM's ``--max-concurrency``).

:func:`run_steady` does that: ``len(prompts)`` requests through ``c`` slots, in order.
The **window** runs from the first request to the moment the first slot finds no
request left (from then on fewer than ``c`` are in flight), and throughput is the tokens
that arrived inside it over its length: the rate at ``c`` concurrent sessions, ramp-up
(prefills, draft warm-ups) included, drain excluded.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.serving_stack import Run, Stream, streamed
from specserve.client import AsyncClient


@dataclass
class SteadyRun:
    """One variant at one concurrency in one repetition, under constant concurrency."""

    variant: str
    concurrency: int
    rep: int
    window_s: float
    window_tokens: int
    streams: list[Stream] = field(default_factory=list)  # in request order

    @property
    def tokens_per_s(self) -> float:
        return self.window_tokens / self.window_s


async def run_steady(
    address: str,
    prompts: Sequence[list[int]],
    concurrency: int,
    new_tokens: int,
    drafter: str,
    k: int | None = None,
    ignore_eos: bool = True,
) -> tuple[float, int, list[Stream]]:
    """Every prompt as a streaming request (greedy; ``k`` None = adaptive), at most
    ``concurrency`` in flight; the window's length, the tokens inside it, every stream."""
    if not 1 <= concurrency <= len(prompts):
        raise ValueError(f"need 1 <= concurrency <= {len(prompts)} requests, got {concurrency}")
    streams: list[Stream | None] = [None] * len(prompts)
    order = iter(range(len(prompts)))
    dry: list[float] = []  # when each slot found no request left
    async with AsyncClient(address, timeout_s=3600) as client:

        async def slot() -> None:
            for i in order:
                streams[i] = await streamed(client, prompts[i], new_tokens, drafter, k, ignore_eos)
            dry.append(time.perf_counter())

        t0 = time.perf_counter()
        await asyncio.gather(*(slot() for _ in range(concurrency)))
    end = min(dry)
    done = [s for s in streams if s is not None]
    inside = sum(n for s in done for t, n in s.arrivals if t <= end)
    return end - t0, inside, done


def steady_prompts(
    prompt_list: Sequence[list[int]], rep: int, concurrency: int, widest: int, waves: int
) -> list[list[int]]:
    """The ``waves * concurrency`` prompts repetition ``rep`` sends at ``concurrency``,
    starting at its own block of ``widest`` (wrapping round the list)."""
    start = rep * widest
    return [prompt_list[(start + i) % len(prompt_list)] for i in range(waves * concurrency)]


def summarize(runs: list[SteadyRun]) -> dict[str, Any]:
    """By sessions: each variant's median tok/s, adaptive / plain by repetition (both ran
    the same prompts in the same order) and its median, and streams whose tokens differ
    from plain decoding's for the same prompt."""
    out: dict[str, Any] = {}
    for c in sorted({r.concurrency for r in runs}):
        mine = {(r.variant, r.rep): r for r in runs if r.concurrency == c}
        reps = sorted({rep for v, rep in mine if v == "adaptive" and ("plain", rep) in mine})
        ratios = [
            mine["adaptive", rep].tokens_per_s / mine["plain", rep].tokens_per_s for rep in reps
        ]
        wrong = sum(
            a.tokens != p.tokens
            for rep in reps
            for a, p in zip(mine["adaptive", rep].streams, mine["plain", rep].streams, strict=True)
        )
        out[str(c)] = {
            "tokens_per_s": {
                v: statistics.median(r.tokens_per_s for (w, _), r in mine.items() if w == v)
                for v in ("plain", "adaptive")
                if any(w == v for w, _ in mine)
            },
            "ratio": statistics.median(ratios) if ratios else None,
            "ratios_by_rep": ratios,
            "requests": sum(len(r.streams) for r in mine.values()),
            "wrong_streams": wrong,
        }
    return out


def tail_of(run: Run) -> dict[str, float]:
    """How a closed batch ended: the share of its wall time after half its streams had
    finished, and the acceptance of its last stream to finish beside the batch's."""
    ends = sorted((s.arrivals[-1][0], s) for s in run.streams if s.arrivals)
    start = min(s.sent for s in run.streams)
    half = ends[(len(ends) - 1) // 2][0]
    last = ends[-1][1]
    drafted = sum(s.drafted for s in run.streams)
    return {
        "tail_share": (ends[-1][0] - half) / (ends[-1][0] - start),
        "last_acceptance": last.accepted / last.drafted if last.drafted else 0.0,
        "batch_acceptance": sum(s.accepted for s in run.streams) / drafted if drafted else 0.0,
    }


def tails(runs: list[Run]) -> dict[str, Any]:
    """:func:`tail_of` for every adaptive closed batch of more than one session, by
    sessions: the median over repetitions and each repetition's."""
    out: dict[str, Any] = {}
    for c in sorted({r.concurrency for r in runs if r.concurrency > 1}):
        each = [
            tail_of(r)
            for r in sorted(runs, key=lambda r: r.rep)
            if r.variant == "adaptive" and r.concurrency == c
        ]
        if each:
            out[str(c)] = {key: statistics.median(t[key] for t in each) for key in each[0]} | {
                "by_rep": each
            }
    return out


def section(steady: dict[str, Any], tail: dict[str, Any]) -> list[str]:
    """The markdown of a setting's steady-load and closed-batch-tail figures."""
    lines = [
        "Constant concurrency (`bench/steady_load.py`: each slot sends its next request as "
        "its last ends; throughput over the window in which every slot was busy):",
        "",
        "| sessions | requests | plain tok/s | adaptive tok/s | adaptive / plain (by repetition) "
        "| wrong |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for c, s in steady.items():
        tps = s["tokens_per_s"]
        each = ", ".join(f"{x:.2f}" for x in s["ratios_by_rep"])
        ratio = "–" if s["ratio"] is None else f"**{s['ratio']:.2f}x** ({each})"
        lines.append(
            f"| {c} | {s['requests']} | {tps.get('plain', 0):.1f} | {tps.get('adaptive', 0):.1f} "
            f"| {ratio} | {s['wrong_streams']} |"
        )
    if tail:
        lines += [
            "",
            "How the adaptive closed batches ended (median over repetitions; by repetition "
            "in brackets): the share of the wall time after half the streams had finished, "
            "and the acceptance of the last stream to finish beside the batch's.",
            "",
            "| sessions | tail share | last stream's acceptance | batch's acceptance |",
            "|---:|---:|---:|---:|",
        ]
        for c, t in tail.items():
            share = ", ".join(f"{x['tail_share']:.0%}" for x in t["by_rep"])
            last = ", ".join(f"{x['last_acceptance']:.0%}" for x in t["by_rep"])
            lines.append(
                f"| {c} | {t['tail_share']:.0%} ({share}) | {t['last_acceptance']:.0%} ({last}) "
                f"| {t['batch_acceptance']:.0%} |"
            )
    return [*lines, ""]
