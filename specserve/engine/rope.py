"""Rotary position embedding with the config's theta and scaling (default, linear, llama3)."""

from __future__ import annotations

import math

import torch

from specserve.engine.config import ModelConfig
from specserve.engine.errors import ModelLoadError


def inverse_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """``inv_freq`` of shape ``[head_dim // 2]`` and the attention scaling factor."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ModelLoadError(f"rope scaling {kind!r} is not supported (default, linear, llama3 are)")


class RotaryEmbedding:
    """Cos/sin tables grown on demand, indexed by absolute position."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.inv_freq, self.scale = inverse_frequencies(cfg)
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)

    def _tables(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] < n or self._cos.device != device:
            size = max(n, 2 * self._cos.shape[0], 1024)
            pos = torch.arange(size, dtype=torch.float32)
            freqs = torch.outer(pos, self.inv_freq)  # [positions, head_dim // 2]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = (emb.cos() * self.scale).to(device)
            self._sin = (emb.sin() * self.scale).to(device)
        return self._cos, self._sin

    def __call__(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        positions: torch.Tensor,  # [tokens]
        max_position: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated to their ``positions``; ``max_position`` (the largest of them,
        known to the caller) spares reading it back from the device."""
        if max_position is None:
            max_position = int(positions.max())
        cos_t, sin_t = self._tables(max_position + 1, q.device)
        cos = cos_t[positions].unsqueeze(1).to(q.dtype)  # [tokens, 1, head_dim]
        sin = sin_t[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
