"""Counter-based randomness: every draw is a pure function of its coordinates.

A speculative round must be replayable on another replica after a failure, and a
seeded request must give the same tokens however the scheduler batches it. So no
draw comes from a stateful generator: each uniform is a hash of

    (seed, round_index, position, stream)

where ``position`` is the absolute index of the token in the session's sequence and
``stream`` separates the draws made at one position for different purposes
(:class:`Stream`). Two draws with different coordinates are independent for every
practical purpose; the same coordinates always give the same number, on any
machine, device or batch composition.

The hash is a chain of SplitMix64 finalisers (Steele, Lea and Flood, "Fast
splittable pseudorandom number generators", OOPSLA 2014): starting from the seed,
each coordinate is xor-ed into the state, the golden-ratio increment is added and
the state is mixed::

    h = mix(seed + GAMMA)
    for word in (round_index, position, stream):
        h = mix((h ^ word) + GAMMA)
    u = (h >> 11) * 2**-53

All arithmetic is modulo 2**64; integers (negative ones included) enter as their
two's-complement value modulo 2**64. ``u`` has 53 random bits, so it lies in
``[0, 1)`` and is exactly representable as a float64.

:func:`uniform` is the plain-Python reference; :func:`uniforms` and
:func:`uniforms_batch` compute the same numbers with numpy ``uint64`` arrays (whose
arithmetic wraps, as the hash needs) and return float64 tensors.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np
import torch

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_INV_2_53 = 1.0 / (1 << 53)


class Stream(enum.IntEnum):
    """What a draw is for; draws at one position in different streams are independent."""

    ACCEPT = 1  # the accept test of a draft token
    RESAMPLE = 2  # the recovered or bonus sample
    DRAFT = 3  # the draft's own sample of its proposed token
    GUMBEL = 4  # the key of a position's Gumbel noise vector (coupled sampling)


def _mix(z: int) -> int:
    """SplitMix64 finaliser on a Python int in [0, 2**64)."""
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK
    return z ^ (z >> 31)


def _hash(seed: int, round_index: int, position: int, stream: int) -> int:
    h = _mix((seed + _GAMMA) & _MASK)
    for word in (round_index, position, stream):
        h = _mix(((h ^ (word & _MASK)) + _GAMMA) & _MASK)
    return h


def uniform(seed: int, round_index: int, position: int, stream: Stream) -> float:
    """One uniform draw in ``[0, 1)`` for the given coordinates (the reference)."""
    return (_hash(seed & _MASK, round_index, position, int(stream)) >> 11) * _INV_2_53


# numpy twins of the constants; uint64 array arithmetic wraps modulo 2**64.
_NP_GAMMA = np.uint64(_GAMMA)
_NP_MUL1 = np.uint64(_MUL1)
_NP_MUL2 = np.uint64(_MUL2)
_S11, _S27, _S30, _S31 = (np.uint64(s) for s in (11, 27, 30, 31))


def _mix_np(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> _S30)) * _NP_MUL1
    z = (z ^ (z >> _S27)) * _NP_MUL2
    return z ^ (z >> _S31)


def _as_u64(values: Sequence[int] | np.ndarray | int, n: int) -> np.ndarray:
    """``values`` (one int, a sequence or an integer array) as uint64 [n], modulo 2**64."""
    if isinstance(values, int):
        return np.full(n, values & _MASK, dtype=np.uint64)
    if isinstance(values, np.ndarray):
        assert values.dtype.kind in "iu", f"integer array expected, got {values.dtype}"
        out = values.astype(np.uint64)  # two's complement for negative int64
    else:
        out = np.fromiter((int(v) & _MASK for v in values), dtype=np.uint64, count=len(values))
    assert out.shape == (n,), f"expected {n} values, got shape {out.shape}"
    return out


def uniforms_batch(
    seeds: Sequence[int] | np.ndarray | int,  # [n] or one for all
    round_indices: Sequence[int] | np.ndarray | int,  # [n] or one for all
    positions: Sequence[int] | np.ndarray,  # [n]
    stream: Stream,
) -> torch.Tensor:
    """Elementwise draws for n coordinate tuples; float64 [n] on the CPU.

    ``uniforms_batch(s, r, x, stream)[i] == uniform(s[i], r[i], x[i], stream)``; a
    scalar seed or round index applies to every position.
    """
    h = hashes_batch(seeds, round_indices, positions, stream)
    return torch.from_numpy((h >> _S11).astype(np.float64) * _INV_2_53)


def hashes_batch(
    seeds: Sequence[int] | np.ndarray | int,  # [n] or one for all
    round_indices: Sequence[int] | np.ndarray | int,  # [n] or one for all
    positions: Sequence[int] | np.ndarray,  # [n]
    stream: Stream,
) -> np.ndarray:
    """The 64-bit hashes [n] (numpy uint64) behind :func:`uniforms_batch`."""
    n = len(positions)
    with np.errstate(over="ignore"):
        h = _mix_np(_as_u64(seeds, n) + _NP_GAMMA)
        for word in (_as_u64(round_indices, n), _as_u64(positions, n)):
            h = _mix_np((h ^ word) + _NP_GAMMA)
        return _mix_np((h ^ np.uint64(int(stream))) + _NP_GAMMA)


def uniforms(seed: int, round_index: int, positions: Sequence[int], stream: Stream) -> torch.Tensor:
    """Draws for one session and round at several positions; float64 [n] on the CPU."""
    return uniforms_batch(seed, round_index, positions, stream)
