"""The sparse proposal distribution q on the wire (``SparseQ``), checked a batch at a time.

A draft token's q travels as ``support`` (id, probability) pairs, row-major
``[k, support]`` per session, as little-endian int32 / float32 bytes, padding
ids -1 with probability 0 (see ``SparseQ`` in common.proto). The acceptance rule
is exact only if q is the distribution the token was really drawn from, so the
target checks, for every row:

* the arrays have ``k x support`` entries and ``support`` is within limits;
* probabilities are finite, in [0, 1], and sum to 1 (within float32 rounding);
* ids are in the vocabulary (or -1 padding with probability 0) and not repeated;
* the row's own draft token has probability > 0 (else ``q(x) = 0``: not sampled from q).

All sessions of a call are checked together, one numpy pass per support width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.engine.errors import InvalidArgument
from specserve.engine.rejection import Proposal
from specserve.v1 import common_pb2

MAX_SUPPORT = 4096  # sparse q entries per draft token
SUM_TOLERANCE = 1e-3  # |sum(q) - 1| allowed per row (float32 on the wire)


@dataclass(frozen=True)
class WireQ:
    """One session's draft tokens and q as they came off the wire (not yet checked)."""

    session_id: str
    tokens: list[int]  # draft tokens, already checked against the vocabulary
    q: common_pb2.SparseQ  # unset = point masses

    @classmethod
    def of(cls, session_id: str, tokens: list[int], q: common_pb2.SparseQ | None) -> WireQ:
        return cls(session_id, tokens, q if q is not None else common_pb2.SparseQ())


def proposals(items: Sequence[WireQ], vocab: int) -> list[Proposal]:
    """Validated :class:`Proposal` objects (q as [k, m] tensors), one per item, in order."""
    out: list[Proposal | None] = [None] * len(items)
    # support width -> (item index, ids bytes, probs bytes) of the items that carry q
    groups: dict[int, list[tuple[int, bytes, bytes]]] = {}
    limit = min(MAX_SUPPORT, vocab)
    for i, x in enumerate(items):
        k, sid, q = len(x.tokens), x.session_id, x.q
        support, ids, probs = q.support, q.ids, q.probs  # each read once: a read copies
        if support == 0:
            if ids or probs:
                raise InvalidArgument(
                    f"session {sid!r}: q carries ids/probs but support is 0; set support to "
                    "the number of q entries per draft token (or send no q for point masses)"
                )
            out[i] = Proposal(tokens=x.tokens)
            continue
        if support > limit:
            raise InvalidArgument(f"session {sid!r}: support {support} exceeds the limit {limit}")
        n = 4 * k * support
        if len(ids) != n or len(probs) != n:
            raise InvalidArgument(
                f"session {sid!r}: {k} draft tokens x support {support} need {n} bytes of "
                f"q ids and of q probs (4 per entry), got {len(ids)} and {len(probs)}"
            )
        if k == 0:
            out[i] = Proposal(tokens=[])
        else:
            groups.setdefault(support, []).append((i, ids, probs))
    for m, group in groups.items():
        _fill(out, items, group, m, vocab)
    assert all(p is not None for p in out)
    return out  # type: ignore[return-value]


def _fill(
    out: list[Proposal | None],
    items: Sequence[WireQ],
    group: list[tuple[int, bytes, bytes]],
    m: int,
    vocab: int,
) -> None:
    """Check the q of one support width ``m`` in one pass and set their proposals."""
    ks = [len(items[i].tokens) for i, _, _ in group]
    rows = sum(ks)
    # [rows, m]; astype copies: the tensors must own writable memory
    ids = np.frombuffer(b"".join(g[1] for g in group), "<i4").astype(np.int64).reshape(rows, m)
    probs = np.frombuffer(b"".join(g[2] for g in group), "<f4").astype(np.float32)
    probs = probs.reshape(rows, m)
    flat = [t for i, _, _ in group for t in items[i].tokens]
    tokens = np.array(flat, dtype=np.int64)  # [rows]
    problem = check_rows(tokens, ids, probs, vocab)
    if problem is not None:
        row, what = problem
        starts = np.cumsum([0, *ks])
        owner = int(np.searchsorted(starts, row, side="right")) - 1
        raise InvalidArgument(
            f"session {items[group[owner][0]].session_id!r}: q of draft position "
            f"{row - int(starts[owner])} {what}"
        )
    # one split into per-session views, not two tensor slicings per session
    ids_parts = torch.from_numpy(ids).split(ks)
    probs_parts = torch.from_numpy(probs).split(ks)
    for (i, _, _), q_ids, q_probs in zip(group, ids_parts, probs_parts, strict=True):
        out[i] = Proposal(tokens=items[i].tokens, q_ids=q_ids, q_probs=q_probs)


def check_rows(
    tokens: np.ndarray,  # [rows] int64, the draft token of each row
    ids: np.ndarray,  # [rows, m] int64
    probs: np.ndarray,  # [rows, m] float32
    vocab: int,
) -> tuple[int, str] | None:
    """The first (row, problem) that makes q unusable, checks in the module doc's order.

    One cheap combined pass decides whether anything is wrong; the per-problem
    passes that name the first offending row run only then.
    """
    in_range = ((probs >= 0) & (probs <= 1)).all()  # False for NaN too
    ids_ok = ((ids >= -1) & (ids < vocab)).all()
    pad_ok = not (probs[ids == -1] != 0).any()
    sums = probs.sum(axis=1, dtype=np.float64)  # [rows]
    ordered = np.sort(ids, axis=1)
    dup = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)  # [rows, m - 1]
    q_at_token = np.where(ids == tokens[:, None], probs, 0).sum(axis=1)  # [rows]
    if (
        in_range
        and ids_ok
        and pad_ok
        and (np.abs(sums - 1.0) <= SUM_TOLERANCE).all()
        and not dup.any()
        and (q_at_token > 0).all()
    ):
        return None
    return _diagnose(tokens, ids, probs, vocab, sums, dup, q_at_token)


def _diagnose(
    tokens: np.ndarray,
    ids: np.ndarray,
    probs: np.ndarray,
    vocab: int,
    sums: np.ndarray,
    dup: np.ndarray,
    q_at_token: np.ndarray,
) -> tuple[int, str]:
    bad = ~np.isfinite(probs)
    if bad.any():
        return _first_row(bad), "holds a probability that is not finite"
    bad = (probs < 0) | (probs > 1)
    if bad.any():
        return _first_row(bad), "holds a probability outside [0, 1]"
    bad = (ids < -1) | (ids >= vocab)
    if bad.any():
        return _first_row(bad), (
            f"names a token id outside the vocabulary (0..{vocab - 1}, -1 = padding)"
        )
    bad = (ids == -1) & (probs != 0)
    if bad.any():
        return _first_row(bad), "gives padding (id -1) a non-zero probability"
    off = np.abs(sums - 1.0) > SUM_TOLERANCE
    if off.any():
        row = int(np.argmax(off))
        return row, f"sums to {sums[row]:.6f}, not 1"
    if dup.any():
        return _first_row(dup), "names the same token id twice"
    row = int(np.argmax(q_at_token <= 0))
    return row, (
        f"gives its own draft token {int(tokens[row])} probability 0: q must be the "
        "distribution the token was sampled from"
    )


def _first_row(mask: np.ndarray) -> int:
    return int(np.argmax(mask.any(axis=1)))


def encode_into(proposals: Sequence[Proposal], out: Sequence[common_pb2.SparseQ]) -> None:
    """Write each proposal's sparse q into its ``out`` message (left unset for point
    masses), as :func:`encode` would: proposals of one support width are converted to
    little-endian bytes in one pass and sliced, not one tensor conversion each."""
    groups: dict[int, list[int]] = {}  # support width -> proposals that carry q
    for i, p in enumerate(proposals):
        if p.q_ids is None or p.q_probs is None or not len(p.tokens):
            continue
        assert p.q_ids.shape == p.q_probs.shape, "dense q is not sent over the wire"
        groups.setdefault(int(p.q_ids.shape[1]), []).append(i)
    for m, idx in groups.items():
        ids = torch.cat([proposals[i].q_ids for i in idx])  # type: ignore[misc]  # [rows, m]
        probs = torch.cat([proposals[i].q_probs for i in idx])  # type: ignore[misc]
        ids_bytes = ids.cpu().numpy().astype("<i4").tobytes()
        probs_bytes = probs.cpu().numpy().astype("<f4").tobytes()
        start = 0
        for i in idx:
            end = start + 4 * m * len(proposals[i].tokens)
            q = out[i]
            q.support = m
            q.ids = ids_bytes[start:end]
            q.probs = probs_bytes[start:end]
            start = end


def encode(p: Proposal) -> common_pb2.SparseQ | None:
    """A proposal's q as a SparseQ message; None for point masses."""
    if p.q_ids is None or p.q_probs is None or not len(p.tokens):
        return None
    assert p.q_ids.shape == p.q_probs.shape, "dense q is not sent over the wire"
    return common_pb2.SparseQ(
        support=int(p.q_ids.shape[1]),
        ids=p.q_ids.cpu().numpy().astype("<i4").tobytes(),
        probs=p.q_probs.cpu().numpy().astype("<f4").tobytes(),
    )
