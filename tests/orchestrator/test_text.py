"""Text deltas: whole characters only, stop-string tails held back, deltas sum to the text."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from specserve.engine.errors import InvalidArgument
from specserve.orchestrator.api.text import TextStream, Tokenization
from specserve.orchestrator.types import ChatMessage, Prompt


class ByteTokenizer:
    """Token i is byte i: multi-byte characters span tokens, like byte-level BPE."""

    vocab_size = 256
    eos_token_ids = (0,)

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        return list(text.encode())[:max_tokens]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages))


def tokenization() -> Tokenization:
    return Tokenization(ByteTokenizer())  # type: ignore[arg-type]


def test_deltas_end_on_character_boundaries() -> None:
    ids = list("añ€😀b".encode())
    stream = TextStream(tokenization())
    deltas = [stream.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + stream.finish(ids, None) == "añ€😀b"
    assert deltas[2] == "ñ" and deltas[1] == ""


def test_stop_string_tail_is_held_back() -> None:
    ids = list(b"hello </stop> world")
    stream = TextStream(tokenization(), stop=["</stop>"])
    sent = "".join(stream.push([i]) for i in ids[:8])  # "hello </s"
    assert sent == "hello "
    cut = len("hello ")
    assert sent + stream.finish(ids[:13], cut) == "hello "


def test_prompts() -> None:
    t = tokenization()
    assert t.encode(Prompt(text="hi")) == [104, 105]
    assert t.encode(Prompt(chat=(ChatMessage("user", "x"),))) == list(b"<user>x")
    with pytest.raises(InvalidArgument, match="role"):
        t.encode(Prompt(chat=(ChatMessage("robot", "x"),)))
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        t.encode(Prompt(token_ids=(1, 300)))
    with pytest.raises(InvalidArgument, match="empty"):
        t.encode(Prompt(token_ids=()))
    bare = Tokenization(None, vocab_size=256)
    with pytest.raises(InvalidArgument, match="token_ids"):
        bare.encode(Prompt(text="hi"))
    assert bare.decode([1, 22]) == " 1 22"


def test_a_completed_stop_string_is_cut() -> None:
    ids = list(b"ab STOP cd")
    stream = TextStream(tokenization(), stop=["STOP"])
    assert stream.push(ids) == "ab "
    assert stream.finish(ids, 3) == ""


def test_a_character_cut_by_the_end_is_not_sent() -> None:
    ids = list("ok😀".encode())[:-2]  # the emoji's last two bytes never came
    stream = TextStream(tokenization())
    assert stream.push(ids) == ""
    assert stream.finish(ids, None) == "ok"


def reference_text(ids: list[int], stop: list[str]) -> str:
    """What the deltas must add up to: the whole text decoded at once, cut before the
    first stop string and before a character the tokens end inside of."""
    text = bytes(ids).decode("utf-8", errors="replace")
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    text = text[: min(hits)] if hits else text
    return text.rstrip("\ufffd")


@pytest.mark.parametrize("seed", range(40))
def test_incremental_deltas_add_up_to_the_text_decoded_at_once(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab <>/STOPñ€😀\n"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80)))
    ids = list(text.encode())
    stop = [s for s in ("</S", "STOP", "b b", "😀<") if rng.random() < 0.5]
    stream = TextStream(tokenization(), stop=stop)
    sent, at = "", 0
    while at < len(ids):
        n = rng.randrange(1, 6)
        delta = stream.push(ids[at : at + n])
        assert "\ufffd" not in delta
        sent += delta
        at += n
        assert reference_text(ids[:at], stop).startswith(sent)
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    assert sent + stream.finish(ids, min(hits) if hits else None) == reference_text(ids, stop)


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return super().decode(ids)


def test_streaming_a_completion_decodes_each_token_a_bounded_number_of_times() -> None:
    counting = CountingTokenizer()
    stream = TextStream(Tokenization(counting))  # type: ignore[arg-type]
    ids = list(("añ€😀b" * 400).encode())
    for i in ids:
        stream.push([i])
    assert stream.sent == "añ€😀b" * 400
    assert counting.decoded <= 8 * len(ids)  # the whole completion each time: n**2 / 2


class LeadingSpaceTokenizer:
    """Word pieces whose text starts with a space the decoder drops at the start of
    a decode (as SentencePiece does): decoding a suffix alone loses that space."""

    vocab_size = 4
    eos_token_ids = ()
    pieces = (" hello", " world", "!", " ok")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids).removeprefix(" ")


def test_deltas_keep_the_space_a_decode_of_the_new_tokens_alone_drops() -> None:
    stream = TextStream(Tokenization(LeadingSpaceTokenizer()))  # type: ignore[arg-type]
    ids = [0, 1, 2, 3, 1]
    deltas = [stream.push([i]) for i in ids]
    assert "".join(deltas) + stream.finish(ids, None) == "hello world! ok world"
    assert deltas[1] == " world"


def test_deltas_of_a_transformers_tokenizer_that_joins_words_with_spaces() -> None:
    """A word-level tokenizers-library tokenizer writes the space between two words only
    when it decodes both: each delta is decoded with the chunk before it."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from specserve.engine.tokenizer import Tokenizer

    words = ["<unk>", "def", "fib", "(", "n", ")", ":", "return"]
    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>"))
    ids = tok.encode("def fib ( n ) : return fib")
    stream = TextStream(Tokenization(tok))
    deltas = [stream.push([i]) for i in ids]
    assert "".join(deltas) + stream.finish(ids, None) == tok.decode(ids)
    assert deltas[1] == " fib"
