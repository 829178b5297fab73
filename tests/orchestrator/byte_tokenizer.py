"""A byte-level tokenizer of exactly 256 tokens (one per byte, no merges), written as a
model directory, so an orchestrator of the tiny test models can take text prompts.

Built with the tokenizers library in the test, nothing downloaded: each UTF-8 byte of a
text is one token id in 0..255, the tiny models' vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = {
    "model_type": "qwen2",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
}


def write_byte_tokenizer(directory: Path) -> Path:
    """Write ``config.json`` and the tokenizer files into ``directory``; return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    raw = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    directory.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(str(directory))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory
