"""Prompts to token ids, and completions to text deltas that end on character boundaries.

The orchestrator holds the target's tokenizer (``--tokenizer``). Without one (tiny
random test models) prompts must be token ids and text is the ids written out
(``" 17 4 230"``), the same convention as local mode, so stop strings still work.

Special tokens (``<|im_end|>``, ...) are left out of the text unless a request keeps
them (``skip_special_tokens``): a turn still ends on its end-of-sequence token, whose
id is in ``token_ids``, but not in the text. One decoder per turn serves both the
stop strings and the text, so a stop string is matched in the text the client gets.

Streaming: a byte-level BPE token can end in the middle of a UTF-8 character; the
decoded text then ends in U+FFFD. :class:`TextStream` holds such a tail back
until the character completes, so every delta is whole characters and the
deltas concatenate to the final text. It also holds back a tail that could be
the start of a stop string: the stop string may complete in the next round,
and the text must end before it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from specserve.engine.errors import InvalidArgument
from specserve.engine.tokenizer import Tokenizer
from specserve.orchestrator.types import Prompt

MAX_PROMPT_TOKENS = 1 << 17
Decode = Callable[[Sequence[int]], str]
CHAT_ROLES = ("system", "user", "assistant")
REPLACEMENT = "\ufffd"


class Tokenization:
    """The target's tokenizer as the orchestrator uses it, or ids-only without one."""

    def __init__(self, tokenizer: Tokenizer | None, *, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size if tokenizer is not None else vocab_size
        self.eos_ids = frozenset(tokenizer.eos_token_ids) if tokenizer is not None else frozenset()

    def encode(self, prompt: Prompt, *, continuing: bool = False) -> list[int]:
        """Token ids of a prompt; InvalidArgument with the reason when it cannot be used."""
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
        elif self.tokenizer is None:
            raise InvalidArgument(
                "this orchestrator has no tokenizer (started without --tokenizer): send the "
                "prompt as token_ids"
            )
        elif prompt.chat is not None:
            if not prompt.chat:
                raise InvalidArgument("the chat prompt has no messages")
            for i, m in enumerate(prompt.chat):
                if m.role not in CHAT_ROLES:
                    raise InvalidArgument(
                        f"chat message {i} has role {m.role!r}; use one of {', '.join(CHAT_ROLES)}"
                    )
            messages = [{"role": m.role, "content": m.content} for m in prompt.chat]
            ids = self.tokenizer.apply_chat_template(messages)
        else:
            # One past the limit is enough to refuse it; the rest never becomes a list.
            ids = self.tokenizer.encode(prompt.text or "", max_tokens=MAX_PROMPT_TOKENS + 1)
        if not ids and not continuing:
            raise InvalidArgument("the prompt is empty: give at least one token")
        if len(ids) > MAX_PROMPT_TOKENS:
            raise InvalidArgument(
                f"the prompt has more than {MAX_PROMPT_TOKENS} tokens; at most "
                f"{MAX_PROMPT_TOKENS} are accepted"
            )
        if self.vocab_size is not None and ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise InvalidArgument(
                f"prompt token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if ids and min(ids) < 0:
            raise InvalidArgument(f"prompt token id {min(ids)} is negative")
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (without a tokenizer: the ids written out, none special)."""
        if self.tokenizer is None:
            return "".join(f" {i}" for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decoder(self, *, skip_special_tokens: bool = True) -> Decode:
        """:meth:`decode` with the turn's choice about special tokens bound."""
        return functools.partial(self.decode, skip_special_tokens=skip_special_tokens)


class TextStream:
    """The text of a growing completion, handed out as deltas on character boundaries.

    Decoding is incremental (as vLLM's detokenizer does it): each :meth:`push` decodes
    only the tokens since the last complete character, with the tokens of the chunk
    before them as context (a tokenizer that drops a leading space at the start of a
    decode drops it from both), so a completion of n tokens costs O(n) to stream,
    not O(n**2). :meth:`finish` decodes the whole completion once."""

    def __init__(
        self,
        tokenization: Tokenization,
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self.decode = tokenization.decoder(skip_special_tokens=skip_special_tokens)
        self.stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = []
        self._text = ""  # the text of _ids[:_read]: whole characters
        self._prefix = 0  # where the last decoded chunk began (the next one's context)
        self._read = 0
        self._sent = 0  # characters of _text handed out

    @property
    def sent(self) -> str:
        """The text handed out so far."""
        return self._text[: self._sent]

    def push(self, new_ids: Sequence[int]) -> str:
        """The completion grew by ``new_ids``: the new text since the last call (empty
        while a character is incomplete or the text's tail may begin a stop string)."""
        self._ids.extend(new_ids)
        self._decode_new()
        text, start = self._text, self._sent
        since = max(0, start - self._longest_stop + 1)  # a stop string never began earlier
        hits = [i for i in (text.find(s, since) for s in self.stop) if i >= 0]
        end = min(hits) if hits else len(text) - self._held_back(text)
        if end <= start:
            return ""
        self._sent = end
        return text[start:end]

    def _decode_new(self) -> None:
        """Extend ``_text`` by the tokens past ``_read``, once they end on a whole character
        (and their text extends the context's: otherwise they wait for :meth:`finish`)."""
        ids = self._ids
        if self._read == len(ids):
            return
        decode = self.decode
        context = decode(ids[self._prefix : self._read])
        window = decode(ids[self._prefix :])
        if window.endswith(REPLACEMENT) or not window.startswith(context):
            return
        self._text += window[len(context) :]
        self._prefix, self._read = self._read, len(ids)

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def finish(self, completion: Sequence[int], text_end: int | None) -> str:
        """The rest of the text at the end (cut where a stop string began, and before a
        character the completion ends inside of)."""
        text = self.decode(completion)
        if text_end is not None:
            text = text[:text_end]
        # Decoding stopped inside a character (max_new_tokens, cancel): its bytes are in
        # the token ids; the text ends before it rather than with U+FFFD.
        text = text.rstrip(REPLACEMENT)
        sent = self.sent
        if not text.startswith(sent):  # cannot happen for byte-level BPE; never resend
            return ""
        self._text, self._sent = text, len(text)
        return text[len(sent) :]
