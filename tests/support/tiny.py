"""Tiny random models for tests (see specserve.engine.tiny)."""

from specserve.engine.tiny import VOCAB, noisy_copy, tiny_config, tiny_model

__all__ = ["VOCAB", "noisy_copy", "tiny_config", "tiny_model"]
