"""Coupled sampling: the Gumbel-max trick with noise fixed by (seed, position).

A sampled session with the coupled rule (:class:`~specserve.engine.sampling.SamplingRule`)
draws the token at absolute position ``t`` of its sequence as

    token(t) = argmax_v  log p_t(v) + g(seed, t, v)

where ``p_t`` is the distribution after temperature, top-k and top-p
(:func:`~specserve.engine.sampling.batched_probabilities`) and ``g`` is a vector of
independent standard Gumbel variates. ``argmax(log p + g)`` is an exact sample from
``p`` (the Gumbel-max trick), and because ``g`` depends on nothing but the seed, the
absolute position and the token id — not on the round, k, the drafter, the batch or
the replica — the token at ``t`` is a function of the seed and the history alone.
The draft proposes ``argmax(log q + g)`` with the same ``g``; the target keeps drafts
while they equal its own choice, so speculation never changes a single token, and it
gains whenever draft and target pick the same one (more often the closer q is to p).

The noise, one float32 per token id::

    key   = hash(seed, 0, position, Stream.GUMBEL)    randomness.hashes_batch; the round
                                                      coordinate is fixed to 0
    h     = mix(key + (id // 2 + 1) * GAMMA)          the SplitMix64 output stream of
                                                      key, one word per pair of ids
    bits  = h >> 41 for an even id, h & (2**23 - 1) for an odd one
    u     = (bits + 0.5) * 2**-23                     exact in float32, never 0 or 1
    g     = -log(-log(u))                             float32

The words are computed with torch int64 arithmetic on the device that holds the
logits (products wrap modulo 2**64 as the hash needs; logical shifts are arithmetic
shifts masked), so only one 64-bit key per row crosses from the host, never a
vocabulary-sized tensor. The 23-bit uniform bounds g to [-2.8, 16.6]: each
truncated tail has probability below 1e-7. The target's choice is computed as
argmax(p / E) with E = -log(u) = exp(-g): the same token for one logarithm per id
(on a CPU with the engine's kernels, one fused pass that takes the logarithm only
where an id may win: ``coupled_argmax`` in :mod:`specserve.engine.cpu_kernels`).
:func:`noise` makes whole rows, :func:`noise_at` the same numbers at chosen ids (a
draft needs only its candidates), :func:`reference_noise` is the plain-Python
definition the tests check both against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from specserve.engine import cpu_kernels, ops
from specserve.engine.randomness import _GAMMA, _MASK, _MUL1, _MUL2, Stream, _mix, hashes_batch

_BITS = 23
_LOW = (1 << _BITS) - 1
_SCALE = 2.0**-_BITS
CPU = torch.device("cpu")


def _signed(x: int) -> int:
    """A 64-bit word as the int64 with the same two's-complement bits."""
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


_GAMMA_I64, _MUL1_I64, _MUL2_I64 = _signed(_GAMMA), _signed(_MUL1), _signed(_MUL2)


def keys(
    seeds: Sequence[int] | np.ndarray | int, positions: Sequence[int] | np.ndarray
) -> np.ndarray:
    """The noise key (numpy uint64 [n]) of each (seed, absolute position)."""
    return hashes_batch(seeds, 0, positions, Stream.GUMBEL)


def noise(row_keys: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """Gumbel noise float32 [n, vocab] for ``row_keys`` uint64 [n], made on ``device``."""
    return _exponentials(row_keys, vocab, device).log_().neg_()


def noise_at(row_keys: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
    """The noise of :func:`noise` at ``ids`` int64 [n, m] only; float32 [n, m] on ids' device."""
    return noise_at_keys(_key_column(row_keys, ids.device), ids)


def noise_at_keys(key: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """:func:`noise_at` for keys already a tensor (int64 [n, 1], the keys' bits, on ids'
    device): tensor ops only, for a static-shape step."""
    words = _words(key, ids >> 1)  # [n, m]
    even = (ids & 1) == 0
    bits = torch.where(even, (words >> (64 - _BITS)) & _LOW, words & _LOW)
    return _exponential(bits.float()).log_().neg_()


def choose(
    probs: torch.Tensor,  # [n, vocab] after temperature / top-k / top-p
    seeds: Sequence[int] | np.ndarray,  # [n]
    positions: Sequence[int] | np.ndarray,  # [n] absolute positions of the tokens drawn
) -> torch.Tensor:
    """The coupled token of each row, int64 [n]: argmax(log p + g(seed, position)).

    Computed as argmax(p / E) with E = exp(-g) = -log(u), the same token (a monotone
    map of every score) for one logarithm per id instead of three.
    """
    if probs.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=probs.device)
    row_keys = keys(seeds, positions)
    kern = cpu_kernels.kernels() if probs.is_cpu and ops.kernels_on() else None
    if kern is not None:  # one pass, a logarithm only where an id may win
        return kern.coupled_argmax(probs.float().contiguous(), _key_column(row_keys, CPU)[:, 0])
    e = _exponentials(row_keys, probs.shape[1], probs.device)  # [n, vocab]
    return (probs.float() / e).argmax(dim=-1)


def choose_among(
    probs: torch.Tensor,  # [n, m] the mass of each candidate (0 = not a candidate)
    ids: torch.Tensor,  # [n, m] int64 token ids of the candidates
    seeds: Sequence[int] | np.ndarray,  # [n]
    positions: Sequence[int] | np.ndarray,  # [n]
) -> torch.Tensor:
    """:func:`choose` over a truncated distribution given sparse; the chosen ids [n]."""
    g = noise_at(keys(seeds, positions), ids)  # [n, m]
    pick = (probs.float().log() + g).argmax(dim=-1, keepdim=True)  # [n, 1]
    return ids.gather(1, pick).squeeze(1)


def reference_noise(seed: int, position: int, token: int) -> float:
    """g(seed, position, token) by the definition above in plain Python (float64)."""
    key = int(keys([seed], [position])[0])
    h = _mix((key + ((token >> 1) + 1) * _GAMMA) & _MASK)
    bits = h >> (64 - _BITS) if token % 2 == 0 else h & _LOW
    return -math.log(-math.log((bits + 0.5) * _SCALE))


def _key_column(row_keys: np.ndarray, device: torch.device) -> torch.Tensor:
    assert row_keys.dtype == np.uint64, f"keys must be uint64, got {row_keys.dtype}"
    return torch.from_numpy(row_keys.view(np.int64).reshape(-1, 1)).to(device)  # [n, 1]


def _words(key: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """mix(key + (pair + 1) * GAMMA) in int64, broadcast over key [n, 1] and pair."""
    z = (pair + 1) * _GAMMA_I64 + key
    z ^= (z >> 30) & ((1 << 34) - 1)  # the masks make the shifts logical
    z *= _MUL1_I64
    z ^= (z >> 27) & ((1 << 37) - 1)
    z *= _MUL2_I64
    z ^= (z >> 31) & ((1 << 33) - 1)
    return z


def _exponentials(row_keys: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """E = -log(u) = exp(-g), float32 [n, vocab], for whole rows."""
    return exponentials(_key_column(row_keys, device), vocab)


def exponentials(key: torch.Tensor, vocab: int) -> torch.Tensor:
    """E = -log(u) = exp(-g), float32 [n, vocab], of the rows whose keys are ``key`` (int64
    [n, 1], the uint64 keys' bits, on the device wanted). Tensor ops only, no value read
    on the host: what a static-shape step (:mod:`specserve.engine.static_step`) calls."""
    pairs = torch.arange((vocab + 1) // 2, dtype=torch.int64, device=key.device)  # [w]
    words = _words(key, pairs[None, :])  # [n, w]
    even = ((words >> (64 - _BITS)) & _LOW).float()  # ids 2i
    odd = (words & _LOW).float()  # ids 2i + 1
    bits = torch.stack((even, odd), dim=-1).reshape(key.shape[0], -1)[:, :vocab]
    return _exponential(bits)


def _exponential(bits: torch.Tensor) -> torch.Tensor:
    """-log(u) for float32 ``bits`` in [0, 2**23), u = (bits + 0.5) * 2**-23, in place."""
    return bits.add_(0.5).mul_(_SCALE).log_().neg_()
