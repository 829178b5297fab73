"""k policies replayed on the model pair's greedy outputs and the draft's confidences.

Under greedy decoding whether a draft token is kept does not depend on the policy:
the draft's i-th token of a round is judged only if the ones before it were kept, so
its context is then the target's own output, and it is kept exactly when the draft's
greedy token after that prefix is the target's. One target output per prompt (the
engine's speculative loop, equal to target-only) and one teacher-forced draft forward
over prompt + output give, at every output position t, ``match[t]`` (the draft's
argmax is output token t) and ``conf[t]`` (the draft's top probability there, what
the drafter multiplies against a session's depth floor). A round that starts at t
keeps the run of matches from t (at most its drafts) and commits one token more, for
any policy.

Costs come from the same process: the target's forward of r rows and the draft's
(r = 1..9, after the first prompt's tokens are cached), and a plain round's overhead
(the local loop's target-only token minus the target's one-row forward). A replayed
round costs the overhead, the draft's forwards (the first feeds what the draft has not
seen: after plain rounds, their tokens), and the target's forward of its drafts + 1
rows; a plain round the local loop's target-only token. The adaptive policies plan
with the costs :class:`~specserve.policy.round_cost.RoundCosts` measures of the
replayed rounds as they go (the local loop's own fitter and timing rule).

Policies: fixed k; the adaptive :class:`~specserve.policy.k_policy.KPolicy` with its
constants and with each varied; the rule it replaced (the k maximising expected tokens
per unit of cost, drafts stopped past a round's first where the draft's top probability
is below 0.5); and an oracle that drafts exactly the run of matches (at most 8): an
upper bound no policy that cannot see the future reaches. Deterministic once measured;
``--replay FILE`` re-runs the policies on a saved JSON without models.

    .venv/bin/python -m bench.k_policy_replay [--prompts 0-19] [--prose 6] [--new-tokens 128]

Writes bench/results/k_policy_replay.{md,json}.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import environment, environment_md, parse_range, reproduce_command, write_results
from specserve.policy.k_policy import KPolicy, expected_tokens
from specserve.policy.round_cost import RoundCosts

ROWS = tuple(range(1, 10))  # the forward costs measured, by rows
ORACLE_K_MAX = 8  # KPolicy's k_max
OLD_CUT = 0.5  # the replaced rule's per-draft cut past a round's first draft


@dataclass(frozen=True)
class Costs:
    """Milliseconds: the target's and the draft's forward by rows, a round's overhead."""

    target: dict[int, float]
    draft: dict[int, float]
    overhead: float

    @property
    def plain(self) -> float:
        return self.overhead + self.target[1]

    def rows(self, table: dict[int, float], r: int) -> float:
        """A forward of ``r`` rows; past the table, its last step per row."""
        top = max(table)
        return table[min(r, top)] + max(0, r - top) * (table[top] - table[top - 1])


# -- measuring --------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every prompt's output with the draft's match and confidence at each position, and
    the forward costs (loads both models as ``bench.quantized`` does)."""
    import torch

    from bench.quantized import Variant, forward_curve, load_specserve, make_prompts, run_variant
    from specserve.engine.drafter import DrafterKind
    from specserve.engine.model import SeqInput

    side = load_specserve(args)
    prompts = make_prompts(side.tokenizer, args.prompts, args.prose)
    vocab = min(side.target.config.vocab_size, side.draft.config.vocab_size)
    spec = Variant("k=4", DrafterKind.MODEL, 4)
    plain = Variant("target-only", "none", 0)
    run_variant(side, spec, prompts[0].ids[:64], 8, ORACLE_K_MAX)  # warm-up: kernel builds
    sequences = []
    for p in prompts:
        out = run_variant(side, spec, p.ids, args.new_tokens, ORACLE_K_MAX)
        tokens = p.ids + out
        kv = side.draft.new_kv_pool(side.draft.config.kv_bytes_per_token * (len(tokens) + 64))
        kv.reserve({"replay": len(tokens)})
        with torch.inference_mode():
            logits = side.draft([SeqInput("replay", tokens, num_logits=len(tokens))], kv)
        top, guess = torch.softmax(logits[:, :vocab].float(), dim=-1).max(dim=-1)
        at = range(len(p.ids) - 1, len(tokens) - 1)
        match = [int(guess[i].item() == tokens[i + 1]) for i in at]
        conf = [round(float(top[i].item()), 5) for i in at]
        sequences.append({"label": p.label, "match": match, "conf": conf})
        print(f"{p.label}: {sum(match)}/{len(match)} matches", flush=True)
    context = prompts[0].ids[:160]
    target = forward_curve(side.target, context, list(ROWS), args.reps)
    draft = forward_curve(side.draft, context, list(ROWS), args.reps)
    run_variant(side, plain, prompts[0].ids, args.new_tokens, ORACLE_K_MAX)
    token_ms = 1e3 * sum(plain.decode_seconds) / sum(plain.decode_tokens)
    return {
        "sequences": sequences,
        "target_ms": target,
        "draft_ms": draft,
        "overhead_ms": max(0.0, token_ms - target[1]),
    }


# -- replaying --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """A replayed policy: a factory of per-prompt :class:`KPolicy` (None: the oracle),
    and how its drafts stop (``product``: the drafter's depth floor; ``per-draft``: the
    replaced rule's cut past the first draft)."""

    make: Callable[[], KPolicy | None]
    stop: str = "product"


class _Replaced(KPolicy):
    """The rule KPolicy had before: the k with the most expected tokens per unit of cost."""

    def plans(self, limit: int) -> list[int]:
        if self.fixed is not None:
            return [self.fixed] * (limit + 1)
        rates = [expected_tokens(self.alpha, k) / self.cost.round(k) for k in range(limit + 1)]
        best = [
            max(range(min(cap, self.k_max) + 1), key=rates.__getitem__) for cap in range(limit + 1)
        ]
        return best

    def drafting_pays(self) -> bool:
        return True


class _GateOnAlpha(KPolicy):
    """KPolicy deciding whether to draft by its per-token acceptance, not its first
    drafts' (one estimate fewer)."""

    def drafting_pays(self) -> bool:
        c = self.cost
        unit = c.draft_per_token + c.verify_per_token + c.fixed
        return self.fixed is not None or self.alpha > unit


def policies() -> dict[str, Policy]:
    out = {f"fixed k={k}": Policy(lambda k=k: KPolicy(k)) for k in (1, 2, 3, 4, 6, 8)}
    out["adaptive (KPolicy)"] = Policy(lambda: KPolicy(None))
    for w in (0.1, 0.2):
        out[f"adaptive, first-draft weight {w}"] = Policy(
            lambda w=w: KPolicy(None, first_smoothing=w)
        )
    out["adaptive, whether to draft by per-token acceptance"] = Policy(lambda: _GateOnAlpha(None))
    for k_max in (4, 5):
        out[f"adaptive, k_max {k_max}"] = Policy(lambda k_max=k_max: KPolicy(None, k_max=k_max))
    out["replaced rule (best expected k, per-draft cut 0.5)"] = Policy(
        lambda: _Replaced(None), "per-draft"
    )
    out["oracle (drafts the run of matches, at most 8)"] = Policy(lambda: None)
    return out


def replay(
    seq: dict[str, Any], policy: KPolicy | None, stop: str, costs: Costs
) -> dict[str, float]:
    """Decode one prompt's output under ``policy``: tokens, milliseconds, rounds, drafts."""
    match, conf = seq["match"], seq["conf"]
    fitter = RoundCosts()
    n, pos, ms, rounds, drafted = len(match), 0, 0.0, 0, 0
    unseen = 1  # committed tokens the draft has not fed yet
    last_k = 0
    while pos < n:
        rounds += 1
        run = 0
        while pos + run < n and match[pos + run]:
            run += 1
        limit = n - pos - 1
        if policy is None:
            k = min(run, limit, ORACLE_K_MAX)
        else:
            policy.measured(fitter.model())
            k = max(0, min(policy.next_k(), limit))
        if k == 0:
            ms += costs.plain
            fitter.observe(1, 0, 0, costs.plain / 1e3)
            pos, unseen, last_k = pos + 1, unseen + 1, 0
            continue
        floor = 0.0 if policy is None else policy.draft_confidence
        proposed, sure, spent, stopped = 0, 1.0, 0.0, False
        for j in range(k):
            spent += costs.rows(costs.draft, unseen if j == 0 else 1)
            q = conf[pos + j]
            if stop == "per-draft" and j > 0 and q < OLD_CUT:
                stopped = True  # the cut draft is dropped; its forward was spent
                break
            proposed += 1
            sure *= q
            if stop == "product" and sure < floor:
                stopped = True
                break
        kept = min(run, proposed)
        seconds = costs.overhead + spent + costs.rows(costs.target, proposed + 1)
        ms += seconds
        if policy is not None:
            policy.observe(proposed, kept)
            if last_k > 0:  # the local loop times a drafting round only after another
                fitter.observe(1, proposed, proposed, seconds / 1e3)
        fed = proposed if stopped else proposed - 1  # drafts the draft ran forwards on
        unseen = 1 if kept <= fed else 2
        pos, last_k, drafted = pos + kept + 1, proposed, drafted + proposed
    return {"tokens": n, "ms": ms, "rounds": rounds, "drafted": drafted}


def simulate(data: dict[str, Any]) -> list[dict[str, Any]]:
    costs = Costs(
        {int(k): v for k, v in data["target_ms"].items()},
        {int(k): v for k, v in data["draft_ms"].items()},
        data["overhead_ms"],
    )
    plain_tps = 1e3 / costs.plain
    rows = []
    for name, policy in policies().items():
        by_class: dict[str, list[float]] = {"code": [0, 0], "prose": [0, 0]}
        worst, rounds, drafted = float("inf"), 0, 0
        for seq in data["sequences"]:
            r = replay(seq, policy.make(), policy.stop, costs)
            cls = "prose" if seq["label"].startswith("prose") else "code"
            by_class[cls][0] += r["tokens"]
            by_class[cls][1] += r["ms"]
            worst = min(worst, r["tokens"] * 1e3 / r["ms"] / plain_tps)
            rounds, drafted = rounds + r["rounds"], drafted + r["drafted"]
        tokens = sum(c[0] for c in by_class.values())
        ms = sum(c[1] for c in by_class.values())
        rows.append(
            {
                "policy": name,
                "tokens_per_s": tokens * 1e3 / ms,
                "vs_target_only": tokens * 1e3 / ms / plain_tps,
                **{
                    f"{cls}_vs_target_only": (c[0] * 1e3 / c[1] / plain_tps if c[1] else None)
                    for cls, c in by_class.items()
                },
                "worst_prompt_vs_target_only": worst,
                "mean_drafted": drafted / rounds,
                "tokens_per_round": tokens / rounds,
            }
        )
    return rows


def _curve(ms: dict[Any, float]) -> str:
    """``1: 41.8, 2: 45.1, ...`` of a forward cost table (JSON keys are strings)."""
    table = {int(r): float(v) for r, v in ms.items()}
    return ", ".join(f"{r}: {table[r]:.1f}" for r in (1, 2, 3, 5, 9) if r in table)


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}x"


def markdown(data: dict[str, Any], rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    seqs = data["sequences"]
    matched = sum(sum(s["match"]) for s in seqs) / sum(len(s["match"]) for s in seqs)
    t, d = _curve(data["target_ms"]), _curve(data["draft_ms"])
    lines = [
        "# k policies replayed on the model pair's outputs and the draft's confidences",
        "",
        f"Target {data['target']}, draft {data['draft']}; {data['prompts_label']}, "
        f"{data['new_tokens']} greedy tokens each (EOS ignored); the draft's greedy token "
        f"matched the target's at {matched:.1%} of positions. Forward ms by rows, target "
        f"{t}; draft {d}; round overhead {data['overhead_ms']:.1f} ms. "
        "Every policy decodes every prompt's match sequence (prefill left out) with those "
        "costs: how a policy chooses, not noise, makes the difference. See the module doc "
        "of `bench/k_policy_replay.py`.",
        "",
        "| policy | tok/s | vs target-only | code | prose | worst prompt | drafted / round "
        "| tokens / round |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['tokens_per_s']:.2f} | {r['vs_target_only']:.3f}x "
            f"| {_ratio(r['code_vs_target_only'])} | {_ratio(r['prose_vs_target_only'])} "
            f"| {r['worst_prompt_vs_target_only']:.3f}x | {r['mean_drafted']:.2f} "
            f"| {r['tokens_per_round']:.2f} |"
        )
    lines += ["", "Reproduce:", "", "```", data["command"], "```", "", environment_md(env)]
    return "\n".join(lines) + "\n"


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["policy"]: r for r in rows}
    adaptive = by["adaptive (KPolicy)"]
    fixed = max(
        (r for r in rows if r["policy"].startswith("fixed")), key=lambda r: r["tokens_per_s"]
    )
    return {
        "adaptive_vs_target_only": adaptive["vs_target_only"],
        "adaptive_prose_vs_target_only": adaptive["prose_vs_target_only"],
        "adaptive_vs_best_fixed": adaptive["tokens_per_s"] / fixed["tokens_per_s"],
        "best_fixed": fixed["policy"],
        "replaced_rule_vs_target_only": by["replaced rule (best expected k, per-draft cut 0.5)"][
            "vs_target_only"
        ],
        "oracle_vs_target_only": by["oracle (drafts the run of matches, at most 8)"][
            "vs_target_only"
        ],
    }


def main(argv: Sequence[str] | None = None) -> None:
    from bench.quantized import DRAFT, TARGET, TINY_DRAFT, TINY_TARGET

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--target-dtype", default="float32")
    p.add_argument("--draft-dtype", default="bfloat16", help="generate --local's default")
    p.add_argument("--prompts", default="0-19", help="HumanEval problem range, e.g. 0-19")
    p.add_argument("--prose", type=int, default=6, help="prose prompts from bench/prompts")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="repetitions of each forward timed")
    p.add_argument("--tiny", action="store_true", help="tiny random models (a smoke run)")
    p.add_argument("--replay", type=Path, help="a saved JSON: re-run the policies only")
    p.add_argument("--name", default="k_policy_replay")
    p.add_argument("--no-write", action="store_true", help="print, do not write results")
    args = p.parse_args(argv)
    if args.tiny:
        args.target, args.draft, args.draft_dtype = TINY_TARGET, TINY_DRAFT, "float32"
    if args.replay:
        saved = json.loads(args.replay.read_text())
        data, env = saved["data"], saved["environment"]
    else:
        import torch

        parse_range(args.prompts)
        torch.set_num_threads(args.threads)
        env = environment()
        data = measure(args)
        data.update(
            target=args.target,
            draft=args.draft,
            prompts_label=f"HumanEval prompts {args.prompts} (raw) and {args.prose} prose "
            "prompts (chat template)",
            new_tokens=args.new_tokens,
            command=reproduce_command("bench.k_policy_replay", list(argv) if argv else None),
        )
    rows = simulate(data)
    text = markdown(data, rows, env)
    print(text)
    if not args.no_write:
        body = {"headline": headline(rows), "data": data, "rows": rows, "environment": env}
        write_results(args.name, text, body)


if __name__ == "__main__":
    main()
