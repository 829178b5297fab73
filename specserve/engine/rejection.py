"""The exact acceptance rule of speculative decoding (pure torch).

Leviathan, Kalman and Matias, arXiv 2211.17192; Chen et al., arXiv 2302.01318.
A draft proposes tokens x_0..x_{k-1}, x_j sampled from its distribution q_j; the
target's distributions p_0..p_k come from one forward pass. Glossary, used in code:

* **accepted** — draft tokens kept. x_j is kept with probability
  ``min(1, p_j(x_j) / q_j(x_j))``, testing j = 0, 1, ... until the first rejection.
* **recovered** — the token sampled at the first rejected position j from the
  residual ``norm(max(0, p_j - q_j))`` (from p_j itself if that is all zero, which
  happens only when p_j == q_j).
* **bonus** — the token sampled from p_k when all k draft tokens were accepted.

A round emits the accepted tokens plus one recovered or bonus token, and the
emitted sequence has exactly the distribution of sampling from p alone, for any
q, provided q is the distribution the draft really sampled from and is sent whole.
Greedy sessions (temperature 0) keep x_j while it equals the argmax of p_j and
emit the argmax at the first mismatch or at the bonus position; this is exact
token equality with target-only greedy decoding. Coupled sessions
(:mod:`specserve.engine.coupling`) follow the same greedy rule over perturbed
scores: the target's choice at a row is ``argmax(log p_j + g(seed, position + j))``,
so they match target-only coupled sampling token for token; q is not used.

Randomness: the accept test of x_j uses ``uniform(seed, round, position + j,
Stream.ACCEPT)``; the recovered or bonus sample at offset j uses ``Stream.RESAMPLE``
at ``position + j`` (see :mod:`specserve.engine.randomness`). A session's verdict
therefore does not depend on which other sessions share its batch.

Vocabulary width: draft and target share a tokenizer, but checkpoints pad their
embedding matrices to different widths. The caller slices both models' logits to
the shared width ``vocab`` *before* computing p and q, so q never puts mass on an
id >= vocab; a q that does is rejected with :class:`InvalidArgument`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.engine import coupling
from specserve.engine.errors import InvalidArgument
from specserve.engine.randomness import Stream, uniforms_batch
from specserve.engine.sampling import SamplingParams, batched_probabilities, sample


@dataclass(frozen=True)
class Proposal:
    """One session's draft for one round. ``q`` comes in three forms: sparse (``q_ids``
    and ``q_probs`` both [k, m], ids padded with -1 and probability 0), dense (``q_probs``
    [k, vocab], ``q_ids`` None), or a point mass on each token (both None: greedy draft,
    n-gram drafter)."""

    tokens: Sequence[int]  # [k], k may be 0
    q_ids: torch.Tensor | None = None  # [k, m] int64, pad -1
    q_probs: torch.Tensor | None = None  # [k, m] sparse or [k, vocab] dense

    def __post_init__(self) -> None:
        k = len(self.tokens)
        if self.q_ids is not None:
            if self.q_probs is None:
                raise InvalidArgument("a draft proposal sent q ids without their probabilities.")
            if self.q_ids.ndim != 2 or self.q_ids.shape[0] != k:
                raise InvalidArgument(
                    f"q ids of shape {tuple(self.q_ids.shape)} do not fit {k} draft tokens."
                )
            if self.q_probs.shape != self.q_ids.shape:
                raise InvalidArgument(
                    f"q probabilities of shape {tuple(self.q_probs.shape)} do not match "
                    f"q ids of shape {tuple(self.q_ids.shape)}."
                )
        elif self.q_probs is not None and (self.q_probs.ndim != 2 or self.q_probs.shape[0] != k):
            raise InvalidArgument(
                f"q probabilities of shape {tuple(self.q_probs.shape)} do not fit {k} draft tokens."
            )


@dataclass(frozen=True)
class Verdict:
    """The outcome of one session's round: accepted drafts, then ``decoded`` (tokens a
    multi-step plain verify decoded before ``next_token``; none otherwise), then next."""

    accepted: int  # draft tokens kept
    next_token: int  # recovered (accepted < k) or bonus (accepted == k)
    decoded: tuple[int, ...] = ()


def verify(
    target_logits: torch.Tensor,  # [sum(k_i + 1), vocab]
    proposals: Sequence[Proposal],  # [batch]
    params: Sequence[SamplingParams],  # [batch]
    round_index: Sequence[int],  # [batch]
    positions: Sequence[int],  # [batch] absolute position of each first draft token
) -> list[Verdict]:
    """Apply the acceptance rule to a batch of sessions; one :class:`Verdict` each.

    Session i owns ``k_i + 1`` consecutive rows of ``target_logits``: p for its draft
    positions 0..k_i-1, then the bonus position. The tensor work runs once for the
    whole batch; Python loops only to gather the proposals and build the verdicts.
    """
    batch = len(proposals)
    if not batch == len(params) == len(round_index) == len(positions):
        raise InvalidArgument(
            f"verify got {batch} proposals, {len(params)} sampling params, "
            f"{len(round_index)} round indices and {len(positions)} positions."
        )
    ks = [len(p.tokens) for p in proposals]
    if all(p.greedy for p in params):
        return _verify_greedy(target_logits, proposals, ks)
    # Also checks that target_logits has sum(k_i + 1) rows.
    probs = batched_probabilities(target_logits, params, [k + 1 for k in ks])  # [R, vocab]
    if batch == 0:
        return []
    device, vocab = target_logits.device, target_logits.shape[1]
    drafts = _Drafts.gather(proposals, vocab, device)
    at = _Layout.of(ks, device)
    u_accept, u_resample = _draws(at, params, round_index, positions, device)
    # Greedy and coupled sessions keep drafts while they equal the target's own choice.
    choice = _choices(target_logits, probs, params, positions, at)  # [R]
    chosen = torch.tensor([p.greedy or p.coupled for p in params])  # [batch] on the host

    # The accept test for every draft token at once, then the length of the leading run.
    p_x = probs[at.draft_row, drafts.tokens].double()  # [T]
    accept = torch.where(
        chosen.to(device)[at.draft_session],
        drafts.tokens == choice[at.draft_row],
        u_accept < _acceptance_probability(p_x, drafts.q_at_token),
    )
    grid = torch.zeros(batch, max(ks), dtype=torch.long, device=device)  # [batch, kmax]
    grid[at.draft_session, at.draft_offset] = accept.long()
    accepted = grid.cumprod(dim=1).sum(dim=1)  # [batch]

    # One recovered or bonus token per session, from the row after the accepted run.
    next_row = at.row_start + accepted  # [batch]
    next_token = choice[next_row]  # right for greedy and coupled sessions
    sampled = (~chosen).nonzero().squeeze(1).to(device)  # [s] under the rejection rule
    if not bool(chosen.all()):
        dist = probs[next_row[sampled]].double()  # [s, vocab]
        rejected = (accepted[sampled] < at.k[sampled]).nonzero().squeeze(1)  # into sampled
        if rejected.numel():
            session = sampled[rejected]
            q = drafts.dense(at.draft_start[session] + accepted[session], vocab)  # [rej, vocab]
            dist[rejected] = _residual(dist[rejected], q)
        next_token[sampled] = sample(dist, u_resample[next_row[sampled]])

    return [
        Verdict(accepted=a, next_token=t)
        for a, t in zip(accepted.tolist(), next_token.tolist(), strict=True)
    ]


def _choices(
    target_logits: torch.Tensor,  # [R, vocab]
    probs: torch.Tensor,  # [R, vocab]
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    at: _Layout,
) -> torch.Tensor:
    """The target's own token per row [R]: argmax, or argmax(log p + g) on coupled rows."""
    coupled = np.fromiter((p.coupled for p in params), bool, len(params))[at.host_row_session]
    rows = np.flatnonzero(coupled)
    session = at.host_row_session[rows]
    seeds = np.fromiter((p.seed & ((1 << 64) - 1) for p in params), np.uint64, len(params))
    where = np.asarray(positions, dtype=np.int64)[session] + at.host_row_offset[rows]
    if coupled.all():  # no gather and scatter of whole rows
        return coupling.choose(probs, seeds[session], where)
    choice = target_logits.argmax(dim=-1)  # first max wins
    index = torch.from_numpy(rows).to(choice.device)
    choice[index] = coupling.choose(probs[index], seeds[session], where)
    return choice


def _verify_greedy(
    target_logits: torch.Tensor,  # [sum(k_i + 1), vocab]
    proposals: Sequence[Proposal],
    ks: Sequence[int],
) -> list[Verdict]:
    """All-greedy batches need only one argmax per row: no probabilities, no draws."""
    rows = sum(ks) + len(ks)
    if target_logits.dim() != 2 or target_logits.shape[0] != rows:
        raise InvalidArgument(
            f"logits of shape {tuple(target_logits.shape)} do not match the {rows} rows "
            "the proposals need (k + 1 per session)"
        )
    vocab = target_logits.shape[1]
    argmax = target_logits.argmax(dim=-1).tolist()  # [R], first max wins
    out = []
    row = 0
    for p, k in zip(proposals, ks, strict=True):
        for t in p.tokens:
            if not 0 <= t < vocab:
                raise InvalidArgument(f"draft token {t} is outside the vocabulary [0, {vocab})")
        j = 0
        while j < k and p.tokens[j] == argmax[row + j]:
            j += 1
        out.append(Verdict(accepted=j, next_token=argmax[row + j]))
        row += k + 1
    return out


@dataclass(frozen=True)
class _Layout:
    """Where each session's rows and draft tokens sit in the flattened batch."""

    k: torch.Tensor  # [batch] draft tokens per session
    row_start: torch.Tensor  # [batch] first target row of each session
    draft_start: torch.Tensor  # [batch] first draft token of each session
    draft_session: torch.Tensor  # [T] session of each draft token
    draft_offset: torch.Tensor  # [T] j of each draft token
    draft_row: torch.Tensor  # [T] target row of each draft token
    host_draft_session: np.ndarray  # [T] as draft_session, on the host
    host_draft_offset: np.ndarray  # [T] as draft_offset, on the host
    host_row_session: np.ndarray  # [R] session of each target row
    host_row_offset: np.ndarray  # [R] j of each target row, k for the bonus row

    @staticmethod
    def of(ks: Sequence[int], device: torch.device) -> _Layout:
        k = np.asarray(ks, dtype=np.int64)
        rows = k + 1
        row_start = np.cumsum(rows) - rows
        draft_start = np.cumsum(k) - k
        row_session = np.repeat(np.arange(len(k)), rows)
        draft_session = np.repeat(np.arange(len(k)), k)
        draft_offset = np.arange(int(k.sum())) - draft_start[draft_session]

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        return _Layout(
            k=t(k),
            row_start=t(row_start),
            draft_start=t(draft_start),
            draft_session=t(draft_session),
            draft_offset=t(draft_offset),
            draft_row=t(row_start[draft_session] + draft_offset),
            host_draft_session=draft_session,
            host_draft_offset=draft_offset,
            host_row_session=row_session,
            host_row_offset=np.arange(int(rows.sum())) - row_start[row_session],
        )


def _draws(
    at: _Layout,
    params: Sequence[SamplingParams],
    round_index: Sequence[int],
    positions: Sequence[int],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept uniforms [T] per draft token and resample uniforms [R] per target row.

    Row j of a session is drawn at position + j; only the row that emits the
    recovered or bonus token uses its draw. All are hashed on the host at once.
    """
    seeds = np.fromiter((p.seed & ((1 << 64) - 1) for p in params), np.uint64, len(params))
    rounds = np.asarray(round_index, dtype=np.int64)
    starts = np.asarray(positions, dtype=np.int64)
    session, offset = at.host_draft_session, at.host_draft_offset
    u_accept = uniforms_batch(
        seeds[session], rounds[session], starts[session] + offset, Stream.ACCEPT
    )
    session, offset = at.host_row_session, at.host_row_offset
    u_resample = uniforms_batch(
        seeds[session], rounds[session], starts[session] + offset, Stream.RESAMPLE
    )
    return u_accept.to(device), u_resample.to(device)


def _acceptance_probability(
    p_x: torch.Tensor,  # [T] float64, p_j(x_j)
    q_x: torch.Tensor,  # [T] float64, q_j(x_j)
) -> torch.Tensor:
    """min(1, p(x) / q(x)) for each draft token; [T] float64."""
    assert bool((q_x > 0).all()), "a draft token has q(x) = 0: q is not what it was sampled from"
    return (p_x / q_x).clamp(max=1.0)


def _residual(
    p: torch.Tensor,  # [r, vocab] float64
    q: torch.Tensor,  # [r, vocab] float64
) -> torch.Tensor:
    """max(0, p - q) per row, or p where that is all zero (p == q); unnormalised, [r, vocab]."""
    residual = (p - q).clamp(min=0.0)
    empty = residual.sum(dim=-1) <= 0
    return torch.where(empty[:, None], p, residual)


_POINT, _DENSE, _SPARSE = 0, 1, 2


@dataclass(frozen=True)
class _Drafts:
    """Every draft token of a batch, flattened in session order, with its q."""

    tokens: torch.Tensor  # [T] int64
    kind: torch.Tensor  # [T] int64: _POINT, _DENSE or _SPARSE
    local: torch.Tensor  # [T] int64 row in the tensor of its kind
    q_at_token: torch.Tensor  # [T] float64, q_j(x_j)
    dense_q: torch.Tensor  # [Td, vocab] in the caller's dtype (no float64 copy of it all)
    sparse_ids: torch.Tensor  # [Ts, m] int64, pad -1
    sparse_q: torch.Tensor  # [Ts, m] float64, pad 0

    @staticmethod
    def gather(proposals: Sequence[Proposal], vocab: int, device: torch.device) -> _Drafts:
        tokens: list[int] = []
        kinds: list[int] = []
        local: list[int] = []
        dense: list[torch.Tensor] = []
        sparse_ids: list[torch.Tensor] = []
        sparse_q: list[torch.Tensor] = []
        counts = [0, 0, 0]
        for i, proposal in enumerate(proposals):
            k = len(proposal.tokens)
            if k == 0:
                continue
            tokens.extend(proposal.tokens)
            if proposal.q_ids is not None:
                kind = _SPARSE
                sparse_ids.append(proposal.q_ids)
                sparse_q.append(proposal.q_probs)  # type: ignore[arg-type]
            elif proposal.q_probs is not None:
                kind = _DENSE
                if proposal.q_probs.shape[1] != vocab:
                    raise InvalidArgument(
                        f"session {i}: dense q has width {proposal.q_probs.shape[1]} but the "
                        f"target's logits have {vocab}; slice both to the shared vocabulary."
                    )
                dense.append(proposal.q_probs)
            else:
                kind = _POINT
            kinds.extend([kind] * k)
            local.extend(range(counts[kind], counts[kind] + k))
            counts[kind] += k

        if tokens and not 0 <= min(tokens) <= max(tokens) < vocab:
            raise InvalidArgument(f"a draft token lies outside the vocabulary [0, {vocab}).")
        tokens_t = torch.tensor(tokens, dtype=torch.long, device=device)
        kind_t = torch.tensor(kinds, dtype=torch.long, device=device)
        local_t = torch.tensor(local, dtype=torch.long, device=device)
        dense_t = _cat(dense, (0, vocab), None, device)
        ids_t, sq_t = _cat_sparse(sparse_ids, sparse_q, device)
        outside = (ids_t < 0) | (ids_t >= vocab)  # [Ts, m]
        if bool((outside & (sq_t > 0)).any()):
            raise InvalidArgument(
                f"a sparse q puts probability on an id outside [0, {vocab}), the target's "
                "vocabulary width; slice the draft's logits to the shared vocabulary and "
                "pad with id -1 and probability 0."
            )
        ids_t = ids_t.masked_fill(outside, -1)  # zero-mass ids past the width are padding

        q_x = torch.ones(len(tokens), dtype=torch.float64, device=device)  # point mass
        where = (kind_t == _DENSE).nonzero().squeeze(1)
        q_x[where] = dense_t[local_t[where], tokens_t[where]].double()
        where = (kind_t == _SPARSE).nonzero().squeeze(1)
        hit = ids_t[local_t[where]] == tokens_t[where, None]  # [Ts, m]
        q_x[where] = (hit * sq_t[local_t[where]]).sum(dim=-1)
        return _Drafts(tokens_t, kind_t, local_t, q_x, dense_t, ids_t, sq_t)

    def dense(self, index: torch.Tensor, vocab: int) -> torch.Tensor:
        """Dense q rows [len(index), vocab] float64 of the draft tokens at ``index`` [r]."""
        q = torch.zeros(len(index), vocab, dtype=torch.float64, device=index.device)
        kind, local = self.kind[index], self.local[index]
        point = (kind == _POINT).nonzero().squeeze(1)
        q[point, self.tokens[index[point]]] = 1.0
        dense = (kind == _DENSE).nonzero().squeeze(1)
        q[dense] = self.dense_q[local[dense]].double()
        sparse = (kind == _SPARSE).nonzero().squeeze(1)
        if sparse.numel():
            ids, probs = self.sparse_ids[local[sparse]], self.sparse_q[local[sparse]]
            q[sparse] = torch.zeros_like(q[sparse]).scatter_add_(
                1, ids.clamp(min=0), probs.masked_fill(ids < 0, 0.0)
            )
        return q


def _cat(
    parts: list[torch.Tensor],
    empty_shape: tuple[int, int],
    dtype: torch.dtype | None,  # None: keep the parts' (promoted) dtype
    device: torch.device,
) -> torch.Tensor:
    if not parts:
        return torch.zeros(empty_shape, dtype=dtype or torch.float32, device=device)
    if len({t.device for t in parts}) > 1:
        parts = [t.to(device) for t in parts]
    # One cat, then one copy: proposals arrive as many small host tensors.
    return torch.cat(parts).to(device=device, dtype=dtype)


def _cat_sparse(
    ids: list[torch.Tensor], probs: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate sparse q of possibly different widths m, padding to the widest."""
    width = max((t.shape[1] for t in ids), default=1)
    pad = torch.nn.functional.pad
    ids = [t if t.shape[1] == width else pad(t, (0, width - t.shape[1]), value=-1) for t in ids]
    probs = [t if t.shape[1] == width else pad(t, (0, width - t.shape[1])) for t in probs]
    return _cat(ids, (0, width), torch.long, device), _cat(probs, (0, width), torch.float64, device)
