"""Text deltas: whole characters only, stop-string tails held back, deltas sum to the text."""

from __future__ import annotations

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

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages))


def tokenization() -> Tokenization:
    return Tokenization(ByteTokenizer())  # type: ignore[arg-type]


def test_deltas_end_on_character_boundaries() -> None:
    ids = list("añ€😀b".encode())
    stream = TextStream(tokenization())
    deltas = [stream.push(ids[: i + 1]) for i in range(len(ids))]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + stream.finish(ids, None) == "añ€😀b"
    assert deltas[2] == "ñ" and deltas[1] == ""


def test_stop_string_tail_is_held_back() -> None:
    ids = list(b"hello </stop> world")
    stream = TextStream(tokenization(), stop=["</stop>"])
    sent = "".join(stream.push(ids[:n]) for n in range(1, 9))  # "hello </s"
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
