"""Statistical exactness: tokens emitted by :func:`verify` are distributed as p.

Each case runs n independent sessions as one batch (seed = session index), a
fixed target row per position and a fixed draft distribution q per position. The
draft samples its tokens from q with the ``DRAFT`` stream, exactly as a drafter
does, and the emitted tokens are compared with the target distribution p (after
temperature, top-k and top-p):

* position 0 of the round: the accepted draft token or the recovered token, which
  must follow p_0 over all sessions;
* position 1, over the sessions that accepted x_0: the accepted x_1, the recovered
  token or (k = 1) the bonus token, which must follow p_1. Since the target rows do
  not depend on the prefix here, conditioning on x_0 being accepted leaves p_1.

The check and its bound. For an event A (a set of tokens), the empirical mass
p̂(A) is a mean of n i.i.d. Bernoulli(p(A)) variables, so Hoeffding gives
P(p̂(A) - p(A) >= t) <= exp(-2 n t^2). Total variation is the largest such gap,
TV(p̂, p) = max_A (p̂(A) - p(A)), and a union bound over the 2^V events gives

    P(TV >= t) <= 2^V exp(-2 n t^2),  so  t(n) = sqrt((V ln 2 + ln(1/δ)) / (2 n)).

With V = 12 and δ = 1e-9: t(8192) = 0.042 and t(131072) = 0.0105. For scale, the
expected TV of a correct sampler is at most ½ Σ sqrt(p(1-p)/n) <= ½ sqrt((V-1)/n)
(0.018 and 0.0046), so t(n) is a little over twice the typical error: loose enough
never to fail a correct rule (probability <= 1e-9 per check), tight enough to
catch a bias above it. Every check runs at n and at 16 n, where the bound is four
times smaller, so the agreement must improve as 1/sqrt(n) rather than stall at a
small bias. The draws are a fixed hash of the seeds, so the outcome is also
reproducible run to run.

One case draws the draft tokens with :func:`draw_rows`, the model drafter's own code,
so what a draft server sends is under the same check; a twin that sends its q but
always its likeliest id fails it.

The twins at the end break the rule on purpose (always accept; recovered drawn
from p instead of norm(max(0, p - q)); recovered drawn with the accept test's own
uniform) and assert that the same check fails; for the first two, the exact TV
of the broken output distribution is computed and shown to exceed twice the bound,
so catching it is not luck.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from specserve.engine import draft_sampling, rejection
from specserve.engine.draft_sampling import DrawRow, draw_rows
from specserve.engine.randomness import Stream, uniforms_batch
from specserve.engine.rejection import Proposal, verify
from specserve.engine.sampling import SamplingParams, SamplingRule, probabilities, sample, truncate

# These tests are of the rejection rule (coupled sampling is the default).
RejectParams = functools.partial(SamplingParams, rule=SamplingRule.REJECTION)

VOCAB = 12
N = 8192
ROUND = 5
POSITION = 40
DELTA = 1e-9


def tv_bound(n: int, vocab: int = VOCAB, delta: float = DELTA) -> float:
    """t with P(TV(p̂_n, p) >= t) <= delta (Hoeffding + union bound over 2^vocab events)."""
    return math.sqrt((vocab * math.log(2) + math.log(1 / delta)) / (2 * n))


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:  # [vocab], [vocab]
    """Total variation between the empirical distribution of ``counts`` and p."""
    empirical = counts.double() / counts.sum()
    return 0.5 * float((empirical - p.double()).abs().sum())


@dataclass(frozen=True)
class Case:
    """One target configuration and one kind of draft."""

    name: str
    target: SamplingParams  # seed is replaced per session
    k: int
    q_kind: str  # "dense", "sparse", "drawn", "point" or "equal" (dense q == p)
    q_top_k: int = 0  # the draft's own truncation, for "sparse"

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fixed target logits [k + 1, vocab] and draft logits [k, vocab]."""
        gen = torch.Generator().manual_seed(zlib.crc32(self.name.encode()))
        target = torch.randn(self.k + 1, VOCAB, generator=gen) * 1.5
        draft = torch.randn(self.k, VOCAB, generator=gen) * 1.5
        return target, draft

    def p(self, position: int) -> torch.Tensor:  # [vocab]
        return probabilities(self.rows()[0][position : position + 1], self.target)[0]

    def q(self) -> torch.Tensor:  # [k, vocab], what the draft samples from
        target, draft = self.rows()
        if self.q_kind == "equal":
            return probabilities(target[: self.k], self.target)
        top_k = self.q_top_k if self.q_kind in ("sparse", "drawn") else 0
        return probabilities(draft, RejectParams(temperature=1.0, top_k=top_k))


def emitted(case: Case, n: int, first_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run n sessions; histograms [vocab] of the tokens emitted at positions 0 and 1."""
    seeds = list(range(first_seed, first_seed + n))
    target_rows, _ = case.rows()
    q = case.q()  # [k, vocab]
    tokens = torch.empty(n, case.k, dtype=torch.long)  # [n, k]
    if case.q_kind == "sparse":
        q_ids, q_probs = truncate(q, case.q_top_k)  # [k, m]
        for j in range(case.k):
            u = uniforms_batch(seeds, ROUND, [POSITION + j] * n, Stream.DRAFT)
            tokens[:, j] = q_ids[j][sample(q_probs[j].expand(n, -1), u)]
        proposals = [Proposal(row, q_ids=q_ids, q_probs=q_probs) for row in tokens.tolist()]
    elif case.q_kind == "drawn":  # draw_rows, as ModelDrafter draws: q is its own top-m
        _, draft_rows = case.rows()
        drawn = []
        for j in range(case.k):
            params = [RejectParams(temperature=1.0, top_k=case.q_top_k, seed=s) for s in seeds]
            rows = [DrawRow(p, ROUND, POSITION + j) for p in params]
            row_tokens, qs = draw_rows(rows, draft_rows[j].expand(n, -1), case.q_top_k)
            tokens[:, j] = torch.tensor(row_tokens)
            drawn.append(qs)
        proposals = [
            Proposal(
                tokens[i].tolist(),
                q_ids=torch.stack([qs[i][0] for qs in drawn]),  # type: ignore[index]
                q_probs=torch.stack([qs[i][1] for qs in drawn]),  # type: ignore[index]
            )
            for i in range(n)
        ]
    elif case.q_kind == "point":  # an n-gram drafter: any token, q = point mass on it
        tokens = (torch.tensor(seeds)[:, None] * 7 + torch.arange(case.k)) % VOCAB
        proposals = [Proposal(row) for row in tokens.tolist()]
    else:
        for j in range(case.k):
            u = uniforms_batch(seeds, ROUND, [POSITION + j] * n, Stream.DRAFT)
            tokens[:, j] = sample(q[j].expand(n, -1), u)
        proposals = [Proposal(row, q_probs=q) for row in tokens.tolist()]

    params = [
        RejectParams(case.target.temperature, case.target.top_k, case.target.top_p, s)
        for s in seeds
    ]
    verdicts = verify(target_rows.repeat(n, 1), proposals, params, [ROUND] * n, [POSITION] * n)
    accepted = torch.tensor([v.accepted for v in verdicts])  # [n]
    next_token = torch.tensor([v.next_token for v in verdicts])  # [n]
    if case.k == 0:
        return torch.bincount(next_token, minlength=VOCAB), torch.zeros(VOCAB)
    first = torch.where(accepted >= 1, tokens[:, 0], next_token)
    reached = accepted >= 1
    if case.k >= 2:
        second = torch.where(accepted >= 2, tokens[:, 1], next_token)[reached]
    else:
        second = next_token[reached]  # the bonus token
    return torch.bincount(first, minlength=VOCAB), torch.bincount(second, minlength=VOCAB)


CASES = [
    Case("dense q, temperature", RejectParams(temperature=0.8), k=2, q_kind="dense"),
    Case("dense q, top-p, bonus", RejectParams(temperature=1.3, top_p=0.8), k=1, q_kind="dense"),
    Case(
        "sparse q, target top-k",
        RejectParams(temperature=1.0, top_k=6),
        k=2,
        q_kind="sparse",
        q_top_k=4,
    ),
    Case(
        "sparse q, top-k and top-p, bonus",
        RejectParams(temperature=0.9, top_k=8, top_p=0.9),
        k=1,
        q_kind="sparse",
        q_top_k=5,
    ),
    Case(
        "the model drafter's own draws",
        RejectParams(temperature=0.8, top_p=0.9),
        k=2,
        q_kind="drawn",
        q_top_k=6,
    ),
    Case("point q", RejectParams(temperature=1.0, top_k=9, top_p=0.95), k=3, q_kind="point"),
    Case("q equals p", RejectParams(temperature=1.1, top_k=7), k=2, q_kind="equal"),
    Case("no draft", RejectParams(temperature=0.7, top_p=0.85), k=0, q_kind="point"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_emitted_tokens_follow_the_target_distribution(case: Case) -> None:
    for n, first_seed in ((N, 0), (16 * N, 10**7)):
        first, second = emitted(case, n, first_seed)
        assert tv(first, case.p(0)) < tv_bound(n), (case.name, n)
        if case.k >= 1:
            reached = int(second.sum())
            assert reached > n // 20, "too few accepted drafts to test position 1"
            assert tv(second, case.p(1)) < tv_bound(reached), (case.name, n, reached)


# ----------------------------------------------------------------- the check has power

DENSE = CASES[0]
BIG = 16 * N


def always_accept(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(p_x)


def recover_from_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p


@pytest.mark.parametrize(
    ("name", "broken", "exact_output"),
    [
        ("always accept", always_accept, lambda p, q: q),
        (
            "recovered from p",
            recover_from_p,
            # accept w.p. min(p, q), else sample p: min(p, q) + (1 - sum min(p, q)) p
            lambda p, q: torch.minimum(p, q) + (1 - torch.minimum(p, q).sum()) * p,
        ),
    ],
)
def test_a_broken_rule_fails_the_same_check(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    broken: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    exact_output: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    p, q = DENSE.p(0).double(), DENSE.q()[0].double()
    bias = 0.5 * float((exact_output(p, q) - p).abs().sum())
    assert bias > 2 * tv_bound(BIG), f"{name}: the case is too weak to test the check"

    target = "_acceptance_probability" if broken is always_accept else "_residual"
    monkeypatch.setattr(rejection, target, broken)
    first, _ = emitted(DENSE, BIG, first_seed=0)
    assert tv(first, DENSE.p(0)) >= tv_bound(BIG), f"the check missed: {name}"


def test_reusing_the_accept_draw_for_the_recovered_token_fails_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rejected token's accept uniform is >= the acceptance probability: reusing it biases."""

    def same_stream(*args: object) -> torch.Tensor:
        seeds, rounds, positions, _ = args
        return uniforms_batch(seeds, rounds, positions, Stream.ACCEPT)  # type: ignore[arg-type]

    monkeypatch.setattr(rejection, "uniforms_batch", same_stream)
    first, _ = emitted(DENSE, BIG, first_seed=0)
    assert tv(first, DENSE.p(0)) >= tv_bound(BIG)


def test_a_draft_that_does_not_draw_from_its_q_fails_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The drafter must draw its token from the q it sends: one that always sends its
    likeliest id (every uniform 0) with the same q makes the output follow neither."""

    def zeros(*args: object) -> torch.Tensor:
        return torch.zeros(len(args[2]), dtype=torch.float64)  # type: ignore[arg-type]

    drawn_case = next(c for c in CASES if c.q_kind == "drawn")
    monkeypatch.setattr(draft_sampling, "uniforms_batch", zeros)
    first, _ = emitted(drawn_case, BIG, first_seed=0)
    assert tv(first, drawn_case.p(0)) >= tv_bound(BIG)
