"""A tokenizer for the tiny random models: 256 ids, one character each, with a chat template.

The tiny models (:mod:`specserve.engine.tiny`) have a 256-token vocabulary and no
tokenizer, so a stack of them takes token ids only. This writes a real
transformers tokenizer directory that fits them exactly, for tests and smoke runs
of everything that needs text: chat prompts (ChatML-style template), stop strings,
end-of-sequence handling, the OpenAI HTTP API, load generators that count tokens.

Ids: 0 ``<|im_start|>``, 1 ``<|im_end|>`` (the end-of-sequence token), 2 ``<unk>``,
3 ``"\\n"``, then 252 single characters from ``" "`` (U+0020) on. Every id decodes to
one character or special token, so any output of a tiny model is printable text.
"""

from __future__ import annotations

import json
from pathlib import Path

from specserve.engine.tiny import VOCAB

SPECIALS = ("<|im_start|>", "<|im_end|>", "<unk>")
EOS_ID = 1
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vocabulary() -> dict[str, int]:
    """Token -> id, exactly :data:`VOCAB` entries."""
    chars = ["\n", *(chr(0x20 + i) for i in range(VOCAB - len(SPECIALS) - 1))]
    return {t: i for i, t in enumerate([*SPECIALS, *chars])}


def write_tiny_tokenizer(directory: Path) -> Path:
    """Write the tokenizer (and a config.json naming its EOS id) into ``directory``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary()
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(directory / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": SPECIALS[EOS_ID],
        "unk_token": "<unk>",
        "pad_token": SPECIALS[EOS_ID],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1 << 17,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    config = {  # read for its EOS ids; the weights come from the tiny: spec
        # llama, not qwen2: transformers would load a qwen2 directory with its byte-level
        # BPE class, which decodes these characters as bytes
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "eos_token_id": EOS_ID,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory
