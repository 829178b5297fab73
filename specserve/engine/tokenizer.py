"""Tokenizer wrapper: encode / decode / chat template, end-of-sequence ids, compatibility.

Wraps a transformers tokenizer so that the rest of the engine sees token id
lists and one set of end-of-sequence ids. Draft and target must tokenize
identically for speculation to be exact; :func:`check_compatible` says why
when they do not.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from specserve.engine.errors import ModelLoadError
from specserve.engine.tokenizer_identity import check_pair, identity_of_tokenizer

# Tokens that end a turn or a document in the chat models we serve. GGUF
# generation configs of the Qwen pair list only <|im_end|>, so we add these
# whenever the vocabulary has them.
EXTRA_EOS_TOKENS = ("<|endoftext|>", "<|im_end|>")


class Tokenizer:
    """A transformers tokenizer plus the end-of-sequence ids the engine stops on."""

    def __init__(self, hf: Any, config_eos_ids: Iterable[int] = ()) -> None:
        self.hf = hf
        vocab = hf.get_vocab()
        ids: list[int] = [int(i) for i in config_eos_ids]
        if hf.eos_token_id is not None:
            ids.append(int(hf.eos_token_id))
        ids.extend(vocab[t] for t in EXTRA_EOS_TOKENS if t in vocab)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (base vocabulary + added tokens).

        Embedding matrices are often padded past this (Qwen2.5: 151936 rows for
        151665 tokens); logits beyond it are never valid tokens.
        """
        return len(self.hf)

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text`` (no special tokens added beyond the tokenizer's defaults),
        at most ``max_tokens`` of them (the rest of the text is still read, in Rust, but
        never becomes Python ints: a prompt over a limit costs the caller little)."""
        if max_tokens is None:
            return list(self.hf.encode(text))
        return list(self.hf.encode(text, truncation=True, max_length=max_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``: by default without special tokens (``<|im_end|>``, ``<|im_start|>``,
        ...), the text a user is shown, as every OpenAI-compatible server gives it;
        ``skip_special_tokens=False`` keeps them (to see a chat template's framing)."""
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat rendered with the model's template, ready for generation."""
        if not getattr(self.hf, "chat_template", None):
            raise ModelLoadError("this tokenizer has no chat template")
        out = self.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        # transformers 5 returns a BatchEncoding (a dict) here, older releases a list.
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in ids]

    def special_tokens(self) -> dict[int, str]:
        """Added special tokens by id."""
        return {
            int(i): str(tok.content)
            for i, tok in self.hf.added_tokens_decoder.items()
            if getattr(tok, "special", False)
        }


def check_compatible(draft: Tokenizer, target: Tokenizer) -> int:
    """Raise :class:`ModelLoadError` unless draft and target tokenize identically.

    Compares the tokenizers' identities (vocabulary size, BOS / EOS / pad ids, the token
    strings by id: :mod:`specserve.engine.tokenizer_identity`), then which added tokens
    are special, never the embedding sizes, which are padded differently between model
    sizes. Returns the shared vocabulary size: draft and target logits may be wider
    than it (padding rows) and are compared only over ``[:size]``.
    """
    check_pair(identity_of_tokenizer(draft), identity_of_tokenizer(target))
    ds, ts = draft.special_tokens(), target.special_tokens()
    if ds != ts:
        only = sorted(set(ds.items()) ^ set(ts.items()))[:3]
        raise ModelLoadError(
            f"draft and target tokenizers differ in which tokens are special, e.g. {only}"
        )
    return target.vocab_size
