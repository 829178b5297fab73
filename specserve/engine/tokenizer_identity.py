"""A tokenizer's identity, and the one rule of a draft/target pair: the same tokenizer.

Speculation is exact only where the draft proposes the ids the target would read for
the same text, so a pair whose tokenizers differ is refused at load, with one sentence
naming the difference. What is compared (cheap, whatever the vocabulary's size):

* the **vocabulary size**: the tokens the tokenizer can produce, never the rows of an
  embedding matrix (padded past it differently by model size: Qwen2.5 0.5B has 151936
  rows, the 7B 152064, for one tokenizer of 151665 tokens). A GGUF file's trailing
  padding entries (llama.cpp's converter writes ``[PAD151665]`` ... as *unused*
  tokens) are not tokens either;
* the **special ids**: BOS, EOS and pad;
* a **digest** of the token strings by id; where it differs, the first id whose
  strings differ is named.

An identity comes from a loaded tokenizer (:func:`identity_of_tokenizer`) or from a GGUF
file's metadata alone (:func:`identity_of_gguf`, no transformers); compare identities
of one kind only (a GGUF file's token strings are llama.cpp's, which transformers may
render otherwise).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specserve.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from specserve.engine.gguf_reader import GGUFCheckpoint
    from specserve.engine.tokenizer import Tokenizer

_SPECIALS = ("BOS", "EOS", "pad")
_GGUF_SPECIAL_KEYS = {
    "BOS": "tokenizer.ggml.bos_token_id",
    "EOS": "tokenizer.ggml.eos_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
}
_GGUF_UNUSED = 5  # llama.cpp's token type of an embedding row that is no token
_PADDING_NAME = re.compile(r"\[PAD\d+\]")


@dataclass(frozen=True)
class TokenizerIdentity:
    """What a draft's and a target's tokenizers must share: the token strings by id
    (compared by :attr:`digest`) and the BOS / EOS / pad ids (None: the tokenizer has
    none)."""

    tokens: tuple[str, ...] = field(repr=False)  # by id; "" for an id no token has
    specials: dict[str, int | None]
    digest: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        h = hashlib.sha256()
        for token in self.tokens:
            h.update(token.encode("utf-8", "surrogatepass") + b"\0")
        object.__setattr__(self, "digest", h.digest())

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)


def identity_of_tokenizer(tokenizer: Tokenizer) -> TokenizerIdentity:
    """The identity of a loaded (transformers) tokenizer."""
    hf = tokenizer.hf
    vocab: dict[str, int] = hf.get_vocab()
    size = max(len(hf), 1 + max(vocab.values(), default=-1))
    tokens = [""] * size
    for token, i in vocab.items():
        tokens[i] = token
    tokens = tokens[: _without_padding(tokens, None)]
    specials = {
        "BOS": hf.bos_token_id,
        "EOS": hf.eos_token_id,
        "pad": hf.pad_token_id,
    }
    return TokenizerIdentity(tuple(tokens), {k: _id(v) for k, v in specials.items()})


def identity_of_gguf(checkpoint: GGUFCheckpoint) -> TokenizerIdentity | None:
    """The identity of a GGUF file's tokenizer from its metadata alone (None where the
    file carries no token list); trailing padding entries are dropped."""
    tokens = checkpoint.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, tuple) or not tokens or not isinstance(tokens[0], str):
        return None
    types = checkpoint.metadata.get("tokenizer.ggml.token_type")
    types = types if isinstance(types, tuple) and len(types) == len(tokens) else None
    end = _without_padding(tokens, types)
    specials = {name: _id(checkpoint.metadata.get(key)) for name, key in _GGUF_SPECIAL_KEYS.items()}
    return TokenizerIdentity(tuple(tokens[:end]), specials)


def _without_padding(tokens: Sequence[str], types: Sequence[int] | None) -> int:
    """How many of ``tokens`` are left without the trailing padding entries (typed
    unused, or named ``[PAD<id>]`` as llama.cpp's converter names them; transformers
    keeps those names when it reads such a GGUF file)."""
    end = len(tokens)
    while end > 0 and (
        (types is not None and types[end - 1] == _GGUF_UNUSED)
        or _PADDING_NAME.fullmatch(tokens[end - 1])
    ):
        end -= 1
    return end


def _id(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]


def pair_difference(draft: TokenizerIdentity, target: TokenizerIdentity) -> str | None:
    """One sentence naming how the draft's tokenizer differs from the target's, or None
    where they are the same."""
    if draft.vocab_size != target.vocab_size:
        return (
            f"draft and target tokenizers differ: the draft's has {draft.vocab_size} tokens, "
            f"the target's {target.vocab_size}"
        )
    specials = [
        f"{name} id {_shown(draft.specials[name])} in the draft, "
        f"{_shown(target.specials[name])} in the target"
        for name in _SPECIALS
        if draft.specials[name] != target.specials[name]
    ]
    if specials:
        return f"draft and target tokenizers differ in their special tokens: {'; '.join(specials)}"
    if draft.digest != target.digest:
        pairs = zip(draft.tokens, target.tokens, strict=True)  # sizes are equal here
        differing = [i for i, (a, b) in enumerate(pairs) if a != b]
        first = differing[0]
        return (
            f"draft and target tokenizers differ: {len(differing)} of their "
            f"{draft.vocab_size} ids name other tokens, first id {first}: "
            f"{draft.tokens[first]!r} in the draft, {target.tokens[first]!r} in the target"
        )
    return None


def _shown(token_id: int | None) -> str:
    return "none" if token_id is None else str(token_id)


def check_pair(draft: TokenizerIdentity, target: TokenizerIdentity) -> None:
    """:class:`ModelLoadError` with :func:`pair_difference`'s sentence unless the two
    identities are the same tokenizer's."""
    difference = pair_difference(draft, target)
    if difference is not None:
        raise ModelLoadError(difference)
