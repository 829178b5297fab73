"""Deterministic cases of the acceptance rule, in the manner of vLLM's rejection-sampler tests.

Spiked logits (one token at +100, the rest at -100) make p a point mass even when
sampling at temperature 1, so the verdict is known in advance. Random cases are
checked against a slow per-session reference that follows the paper line by line.
"""

from __future__ import annotations

import functools

import pytest
import torch

from specserve.engine.errors import InvalidArgument
from specserve.engine.randomness import Stream, uniform, uniforms_batch
from specserve.engine.rejection import Proposal, Verdict, _residual, verify
from specserve.engine.sampling import SamplingParams, SamplingRule, probabilities, sample, truncate

# These tests are of the rejection rule (coupled sampling is the default).
RejectParams = functools.partial(SamplingParams, rule=SamplingRule.REJECTION)

VOCAB = 32
GREEDY = RejectParams()
SAMPLED = RejectParams(temperature=1.0, seed=7)


def spiked(targets: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """Logits [len(targets), vocab] whose row j puts all mass on targets[j]."""
    logits = torch.full((len(targets), vocab), -100.0)
    logits[torch.arange(len(targets)), torch.tensor(targets, dtype=torch.long)] = 100.0
    return logits


def draft(tokens: list[int], kind: str, vocab: int = VOCAB) -> Proposal:
    """A proposal whose q contains each token but is not a point mass (unless kind == point)."""
    k = len(tokens)
    if kind == "point":
        return Proposal(tokens=tokens)
    dense = torch.full((k, vocab), 0.5 / (vocab - 1))
    dense[torch.arange(k), torch.tensor(tokens, dtype=torch.long)] = 0.5
    if kind == "dense":
        return Proposal(tokens=tokens, q_probs=dense)
    ids, probs = truncate(dense, vocab)
    return Proposal(tokens=tokens, q_ids=ids, q_probs=probs)


def run(targets: list[int], tokens: list[int], params: SamplingParams, kind: str) -> Verdict:
    [verdict] = verify(spiked(targets), [draft(tokens, kind)], [params], [0], [10])
    return verdict


KINDS = ["point", "dense", "sparse"]
PARAMS = [GREEDY, SAMPLED, RejectParams(temperature=0.7, top_k=3, top_p=0.9, seed=1)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled", "filtered"])
class TestSpiked:
    def test_all_accepted_gives_the_bonus(self, params: SamplingParams, kind: str) -> None:
        assert run([1, 2, 3, 4], [1, 2, 3], params, kind) == Verdict(accepted=3, next_token=4)

    def test_first_rejected_gives_the_recovered(self, params: SamplingParams, kind: str) -> None:
        assert run([7, 2, 3, 4], [1, 2, 3], params, kind) == Verdict(accepted=0, next_token=7)

    def test_middle_rejected(self, params: SamplingParams, kind: str) -> None:
        assert run([1, 9, 3, 4], [1, 2, 3], params, kind) == Verdict(accepted=1, next_token=9)

    def test_last_rejected(self, params: SamplingParams, kind: str) -> None:
        assert run([1, 2, 0, 4], [1, 2, 3], params, kind) == Verdict(accepted=2, next_token=0)

    def test_empty_draft(self, params: SamplingParams, kind: str) -> None:
        assert run([5], [], params, kind) == Verdict(accepted=0, next_token=5)


def test_mixed_batch_with_different_k() -> None:
    cases = [  # (target argmax per row, draft tokens, params, q kind, expected)
        ([1, 2, 3, 4], [1, 2, 3], GREEDY, "point", Verdict(3, 4)),
        ([5], [], SAMPLED, "point", Verdict(0, 5)),
        ([1, 8, 3], [1, 2], SAMPLED, "dense", Verdict(1, 8)),
        ([6, 2], [1], GREEDY, "sparse", Verdict(0, 6)),
        (
            [3, 4, 5, 6, 7, 8, 9, 10, 11],
            [3, 4, 5, 6, 7, 8, 9, 10],
            SAMPLED,
            "sparse",
            Verdict(8, 11),
        ),
        ([0], [], GREEDY, "dense", Verdict(0, 0)),
        ([2, 2, 9], [2, 2], RejectParams(temperature=2.0, top_k=1), "point", Verdict(2, 9)),
    ]
    logits = torch.cat([spiked(c[0]) for c in cases])
    verdicts = verify(
        logits,
        [draft(c[1], c[3]) for c in cases],
        [c[2] for c in cases],
        list(range(len(cases))),
        [100 * i for i in range(len(cases))],
    )
    assert verdicts == [c[4] for c in cases]


def test_empty_draft_samples_from_p_with_the_resample_stream() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, VOCAB, generator=gen)
    params = [RejectParams(temperature=1.2, top_p=0.8, seed=s) for s in range(50)]
    verdicts = verify(logits, [Proposal(tokens=[])] * 50, params, [3] * 50, [17] * 50)
    u = uniforms_batch(list(range(50)), 3, [17] * 50, Stream.RESAMPLE)
    p = torch.cat([probabilities(logits[i : i + 1], params[i]) for i in range(50)])
    assert [v.next_token for v in verdicts] == sample(p, u).tolist()
    assert all(v.accepted == 0 for v in verdicts)
    assert len({v.next_token for v in verdicts}) > 3  # really sampled


def test_rejection_draws_recovered_from_the_residual() -> None:
    # p = (0.5, 0.5, 0, ...), q = point mass on 0: accept iff u < 0.5, else recover 1.
    logits = torch.full((2, 4), -torch.inf)
    logits[:, :2] = 0.0
    seeds = range(400)
    verdicts = verify(
        logits.repeat(len(seeds), 1),
        [Proposal(tokens=[0])] * len(seeds),
        [RejectParams(temperature=1.0, seed=s) for s in seeds],
        [2] * len(seeds),
        [30] * len(seeds),
    )
    for seed, v in zip(seeds, verdicts, strict=True):
        accept = uniform(seed, 2, 30, Stream.ACCEPT) < 0.5
        assert v.accepted == int(accept)
        if not accept:
            assert v.next_token == 1  # the residual has no mass on the proposed token
    assert 0 < sum(v.accepted for v in verdicts) < len(seeds)


def test_residual_falls_back_to_p_when_p_equals_q() -> None:
    p = torch.tensor([[0.25, 0.75, 0.0], [0.5, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.75, 0.0], [0.25, 0.5, 0.25]], dtype=torch.float64)
    got = _residual(p, q)
    assert got.tolist() == [[0.25, 0.75, 0.0], [0.25, 0.0, 0.0]]


# ----------------------------------------------------------------- against a reference


def reference(
    logits: torch.Tensor,  # [k + 1, vocab]
    proposal: Proposal,
    params: SamplingParams,
    round_index: int,
    position: int,
) -> Verdict:
    """The rule of arXiv 2211.17192, one session and one token at a time."""
    p = probabilities(logits, params).double()  # [k + 1, vocab]
    vocab = logits.shape[1]
    for j, x in enumerate(proposal.tokens):
        if params.greedy:
            best = int(torch.argmax(logits[j]))
            if x != best:
                return Verdict(j, best)
            continue
        if proposal.q_ids is not None:
            q = torch.zeros(vocab, dtype=torch.float64)
            q.scatter_add_(0, proposal.q_ids[j].clamp(min=0), proposal.q_probs[j].double())
        elif proposal.q_probs is not None:
            q = proposal.q_probs[j].double()
        else:
            q = torch.nn.functional.one_hot(torch.tensor(x), vocab).double()
        u = uniform(params.seed, round_index, position + j, Stream.ACCEPT)
        if u < min(1.0, float(p[j, x] / q[x])):
            continue
        residual = (p[j] - q).clamp(min=0)
        if residual.sum() == 0:
            residual = p[j]
        return Verdict(
            j, sample(residual, uniform(params.seed, round_index, position + j, Stream.RESAMPLE))
        )
    k = len(proposal.tokens)
    if params.greedy:
        return Verdict(k, int(torch.argmax(logits[k])))
    return Verdict(
        k, sample(p[k], uniform(params.seed, round_index, position + k, Stream.RESAMPLE))
    )


def random_batch(
    n: int, seed: int, vocab: int = 16
) -> tuple[torch.Tensor, list[Proposal], list[SamplingParams], list[int], list[int]]:
    """n sessions with random k, q kinds, params and draft tokens drawn from q."""
    gen = torch.Generator().manual_seed(seed)

    def rand_int(hi: int) -> int:
        return int(torch.randint(hi, (1,), generator=gen))

    logits, proposals, params = [], [], []
    for i in range(n):
        k = rand_int(5)
        kind = KINDS[rand_int(3)]
        target = torch.randn(k + 1, vocab, generator=gen) * 2  # [k + 1, vocab]
        logits.append(target)
        p = [
            GREEDY,
            RejectParams(temperature=1.0, seed=i),
            RejectParams(temperature=0.6, top_k=4, seed=i),
            RejectParams(temperature=1.5, top_p=0.7, seed=i),
        ][rand_int(4)]
        params.append(p)
        if kind == "point":  # half the time the target's argmax, as an n-gram hit would be
            best = target[:k].argmax(dim=-1).tolist()
            tokens = [best[j] if rand_int(2) else rand_int(vocab) for j in range(k)]
            proposals.append(Proposal(tokens=tokens))
            continue
        # A draft that roughly agrees with the target, so that drafts are accepted.
        top_k = 6 if kind == "sparse" else 0
        q_params = RejectParams(temperature=1.0, top_k=top_k)
        q_logits = target[:k] + torch.randn(k, vocab, generator=gen)  # [k, vocab]
        q = probabilities(q_logits, q_params)
        tokens = sample(q, torch.rand(k, dtype=torch.float64, generator=gen)).tolist()
        if kind == "dense":
            proposals.append(Proposal(tokens=tokens, q_probs=q))
        else:
            ids, probs = truncate(q, 6 + rand_int(3))  # sparse widths differ in the batch
            proposals.append(Proposal(tokens=tokens, q_ids=ids, q_probs=probs))
    rounds = [rand_int(1000) for _ in range(n)]
    positions = [rand_int(1000) for _ in range(n)]
    return torch.cat(logits), proposals, params, rounds, positions


def test_vectorised_verify_matches_the_reference() -> None:
    logits, proposals, params, rounds, positions = random_batch(300, seed=0)
    verdicts = verify(logits, proposals, params, rounds, positions)
    row = 0
    for i, v in enumerate(verdicts):
        k = len(proposals[i].tokens)
        rows = logits[row : row + k + 1]
        assert v == reference(rows, proposals[i], params[i], rounds[i], positions[i]), i
        row += k + 1
    # Not vacuous: some drafts were accepted, some fully, some rejected.
    ks = [len(p.tokens) for p in proposals]
    assert sum(v.accepted for v in verdicts) > 100
    assert any(v.accepted == k > 0 for v, k in zip(verdicts, ks, strict=True))
    assert any(v.accepted < k for v, k in zip(verdicts, ks, strict=True))


# ------------------------------------------------------------------------- determinism


def test_seeded_verdicts_repeat_across_runs() -> None:
    batch = random_batch(64, seed=1)
    assert verify(*batch) == verify(*batch)


def test_seeded_verdicts_are_pinned() -> None:
    """A seeded round replayed by another process or version must give the same tokens."""
    vocab, k = 8, 3
    grid = torch.arange(6 * (k + 1) * vocab, dtype=torch.float64).reshape(6 * (k + 1), vocab)
    logits = (torch.sin(grid * 0.7) * 2).float()  # [6 * (k + 1), vocab], no generator involved
    cosines = torch.cos(torch.arange(k * vocab, dtype=torch.float64) * 0.3)
    q = torch.softmax(cosines.reshape(k, vocab), dim=-1)  # [k, vocab]
    proposals = [Proposal([1, 2, 3], q_probs=q), Proposal([0, 7, 4], q_probs=q), Proposal([5] * 3)]
    params = [RejectParams(temperature=1.0, seed=s) for s in range(6)]
    verdicts = verify(logits, proposals * 2, params, list(range(6)), [10, 20, 30, 40, 50, 60])
    assert verdicts == [
        Verdict(3, 6),
        Verdict(0, 5),
        Verdict(0, 2),
        Verdict(0, 4),
        Verdict(1, 1),
        Verdict(1, 4),
    ]


def test_a_session_gets_the_same_verdict_alone_or_batched() -> None:
    logits, proposals, params, rounds, positions = random_batch(40, seed=2)
    batched = verify(logits, proposals, params, rounds, positions)
    row = 0
    for i, proposal in enumerate(proposals):
        k = len(proposal.tokens)
        alone = verify(
            logits[row : row + k + 1], [proposal], [params[i]], [rounds[i]], [positions[i]]
        )
        assert alone == [batched[i]]
        row += k + 1
    # And in another order, with different neighbours.
    order = list(range(39, -1, -1))
    starts = [sum(len(p.tokens) + 1 for p in proposals[:i]) for i in range(40)]
    shuffled = torch.cat(
        [logits[starts[i] : starts[i] + len(proposals[i].tokens) + 1] for i in order]
    )
    again = verify(
        shuffled,
        [proposals[i] for i in order],
        [params[i] for i in order],
        [rounds[i] for i in order],
        [positions[i] for i in order],
    )
    assert again == [batched[i] for i in order]


def test_round_index_and_seed_change_the_draws() -> None:
    logits = torch.zeros(2, 8)  # p uniform over 8: accept a point mass w.p. 1/8
    proposal = Proposal(tokens=[3])
    by_round = {
        verify(logits, [proposal], [RejectParams(temperature=1.0)], [r], [0])[0] for r in range(40)
    }
    by_seed = {
        verify(logits, [proposal], [RejectParams(temperature=1.0, seed=s)], [0], [0])[0]
        for s in range(40)
    }
    assert len(by_round) > 3 and len(by_seed) > 3


# ------------------------------------------------------------------------ bad requests


def test_bad_requests_raise_invalid_argument() -> None:
    logits = spiked([1, 2])
    with pytest.raises(InvalidArgument, match="1 proposals, 2 sampling params"):
        verify(logits, [Proposal([1])], [GREEDY, GREEDY], [0], [0])
    with pytest.raises(InvalidArgument, match="do not match the 3 rows"):
        verify(logits, [Proposal([1, 2])], [GREEDY], [0], [0])
    with pytest.raises(InvalidArgument, match=r"outside the vocabulary \[0, 32\)"):
        verify(logits, [Proposal([32])], [GREEDY], [0], [0])
    with pytest.raises(
        InvalidArgument, match="dense q has width 40 but the target's logits have 32"
    ):
        verify(logits, [Proposal([1], q_probs=torch.full((1, 40), 1 / 40))], [SAMPLED], [0], [0])
    ids = torch.tensor([[1, 40]])
    with pytest.raises(InvalidArgument, match=r"probability on an id outside \[0, 32\)"):
        verify(
            logits, [Proposal([1], q_ids=ids, q_probs=torch.full((1, 2), 0.5))], [SAMPLED], [0], [0]
        )


def test_malformed_proposals_raise_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="q ids without their probabilities"):
        Proposal([1], q_ids=torch.tensor([[1]]))
    with pytest.raises(InvalidArgument, match="do not fit 2 draft tokens"):
        Proposal([1, 2], q_ids=torch.tensor([[1]]), q_probs=torch.tensor([[1.0]]))
    with pytest.raises(InvalidArgument, match="do not match q ids"):
        Proposal([1], q_ids=torch.tensor([[1, 2]]), q_probs=torch.tensor([[1.0]]))
    with pytest.raises(InvalidArgument, match="do not fit 1 draft tokens"):
        Proposal([1], q_probs=torch.ones(2, 4) / 4)


def test_zero_mass_ids_past_the_vocabulary_are_padding() -> None:
    # A draft whose embedding is padded wider may name such ids with probability 0.
    ids = torch.tensor([[1, 40, -1]])
    probs = torch.tensor([[1.0, 0.0, 0.0]])
    proposal = Proposal([1], q_ids=ids, q_probs=probs)
    assert verify(spiked([1, 2]), [proposal], [SAMPLED], [0], [0]) == [Verdict(1, 2)]
    assert verify(spiked([3, 2]), [proposal], [SAMPLED], [0], [0]) == [Verdict(0, 3)]


def test_a_token_outside_q_is_a_caller_bug() -> None:
    ids, probs = torch.tensor([[2, 3]]), torch.tensor([[0.5, 0.5]])
    with pytest.raises(AssertionError, match=r"q\(x\) = 0"):
        verify(spiked([1, 2]), [Proposal([1], q_ids=ids, q_probs=probs)], [SAMPLED], [0], [0])


def test_empty_batch() -> None:
    assert verify(torch.zeros(0, VOCAB), [], [], [], []) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_verify_on_cuda_matches_cpu() -> None:
    logits, proposals, params, rounds, positions = random_batch(300, seed=3)
    on_cpu = verify(logits, proposals, params, rounds, positions)
    # q stays on the host, as it arrives over gRPC; the logits live on the device.
    on_gpu = verify(logits.cuda(), proposals, params, rounds, positions)
    for p, a, b in zip(params, on_cpu, on_gpu, strict=True):
        if p.greedy:
            assert a == b
    # Softmax may round differently on the device; a draw on a CDF boundary may flip.
    assert sum(a != b for a, b in zip(on_cpu, on_gpu, strict=True)) <= 3
