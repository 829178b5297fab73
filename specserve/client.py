"""Python client of the public ``Generation`` API: :class:`Client` (sync) and :class:`AsyncClient`.

    with Client("127.0.0.1:50051") as c:
        print(c.generate("def fib(n):", max_new_tokens=64).text)
        for delta in c.stream([1, 2, 3], keep_session=True):
            print(delta.text, end="")

A prompt is text (a ``str``), token ids (a sequence of ``int``) or chat messages
(a sequence of ``{"role": ..., "content": ...}``). Failed calls raise
:class:`grpc.RpcError` (``.code()``, ``.details()``). Imports no torch.

An orchestrator serving TLS and asking for API keys (``docs/security.md``)::

    tls = ClientTls(ca_file="ca.pem")  # the CA of the orchestrator's certificate
    with Client("orchestrator:50051", tls=tls, api_key=os.environ["SPECSERVE_API_KEY"]) as c:
        ...

The key travels as gRPC metadata ``authorization: Bearer <key>`` on every call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from specserve.serving.tls import ClientTls, aio_channel, sync_channel
from specserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

__all__ = ["AsyncClient", "Client", "ClientTls", "Completion", "Delta", "Usage"]

PromptLike = str | Sequence[int] | Sequence[Mapping[str, str]]
DRAFTERS = {
    None: common_pb2.DRAFTER_UNSPECIFIED,
    "model": common_pb2.DRAFTER_MODEL,
    "ngram": common_pb2.DRAFTER_NGRAM,
    "none": common_pb2.DRAFTER_NONE,
}
RULES = {
    None: common_pb2.SAMPLING_RULE_UNSPECIFIED,
    "coupled": common_pb2.SAMPLING_RULE_COUPLED,
    "rejection": common_pb2.SAMPLING_RULE_REJECTION,
}
FINISH_NAMES = {
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_EOS: "eos",
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_CANCELLED: "cancelled",
}
Metadata = tuple[tuple[str, str], ...]


def auth_metadata(api_key: str | None) -> Metadata:
    """The call metadata that carries an API key (none without one)."""
    if api_key is None:
        return ()
    if not api_key or any(c.isspace() for c in api_key):
        raise ValueError("an API key is one word without spaces")
    return (("authorization", f"Bearer {api_key}"),)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_acceptance_length: float = 0.0

    @classmethod
    def of(cls, pb: generate_pb2.Usage) -> Usage:
        return cls(
            pb.prompt_tokens,
            pb.completion_tokens,
            pb.rounds,
            pb.drafted_tokens,
            pb.accepted_tokens,
            pb.acceptance_rate,
            pb.mean_acceptance_length,
        )


@dataclass(frozen=True)
class Completion:
    session_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    time_to_first_token_s: float
    duration_s: float
    seed: int = 0  # the seed the turn sampled with (the request's or the server's)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.duration_s if self.duration_s > 0 else 0.0


@dataclass(frozen=True)
class Delta:
    """Text and tokens committed since the previous delta; the last one has the finish."""

    session_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    seed: int = 0  # the seed the turn samples with (the request's or the server's)


def request(
    prompt: PromptLike,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    max_new_tokens: int = 0,
    stop: Sequence[str] = (),
    drafter: str | None = None,
    k: int | None = None,
    session_id: str = "",
    keep_session: bool = False,
    rule: str | None = None,
    ignore_eos: bool = False,
    logprobs: int | None = None,
    skip_special_tokens: bool = True,
) -> generate_pb2.GenerateRequest:
    """The GenerateRequest for these arguments (``max_new_tokens`` 0 = the server's default;
    ``rule`` "coupled" or "rejection", None = the server's default, coupled; ``logprobs``:
    alternatives per token, None = no log-probabilities; ``skip_special_tokens=False``
    keeps special tokens such as ``<|im_end|>`` in the text)."""
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of model, ngram, none; got {drafter!r}")
    if rule not in RULES:
        raise ValueError(f"rule must be coupled or rejection; got {rule!r}")
    req = generate_pb2.GenerateRequest(session_id=session_id, keep_session=keep_session)
    if isinstance(prompt, str):
        req.text = prompt
    elif all(isinstance(t, int) for t in prompt):
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    else:
        for m in prompt:
            req.chat.messages.add(role=m["role"], content=m["content"])  # type: ignore[index]
    s = req.sampling
    s.temperature, s.top_p, s.top_k, s.max_new_tokens = temperature, top_p, top_k, max_new_tokens
    s.stop.extend(stop)
    if seed is not None:
        s.seed = seed
    s.rule = RULES[rule]
    s.ignore_eos = ignore_eos
    if logprobs is not None:
        s.logprobs = logprobs
    if not skip_special_tokens:  # unset is the server's default, true
        s.skip_special_tokens = False
    req.speculation.drafter = DRAFTERS[drafter]
    if k is not None:
        req.speculation.k = k
    return req


def completion(pb: generate_pb2.GenerateResponse) -> Completion:
    return Completion(
        pb.session_id,
        pb.text,
        list(pb.token_ids),
        FINISH_NAMES.get(pb.finish_reason, ""),
        Usage.of(pb.usage),
        pb.time_to_first_token_ns / 1e9,
        pb.duration_ns / 1e9,
        pb.seed,
    )


def delta(pb: generate_pb2.GenerateStreamResponse) -> Delta:
    last = pb.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
    return Delta(
        pb.session_id,
        pb.text,
        list(pb.token_ids),
        FINISH_NAMES.get(pb.finish_reason) if last else None,
        Usage.of(pb.usage) if last else None,
        pb.seed,
    )


class Client:
    """Blocking client; ``stream`` returns an iterator whose ``cancel()`` stops the generation."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        *,
        timeout_s: float | None = None,
        tls: ClientTls | None = None,
        api_key: str | None = None,
    ):
        """``tls``: connect over TLS (None: plaintext); ``api_key``: sent on every call."""
        self.channel = sync_channel(address, tls)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = auth_metadata(api_key)

    def generate(self, prompt: PromptLike, **kwargs: Any) -> Completion:
        timeout = kwargs.pop("timeout_s", self.timeout_s)
        return completion(
            self.stub.Generate(request(prompt, **kwargs), timeout=timeout, metadata=self.metadata)
        )

    def stream(self, prompt: PromptLike, **kwargs: Any) -> Stream:
        timeout = kwargs.pop("timeout_s", self.timeout_s)
        return Stream(
            self.stub.GenerateStream(
                request(prompt, **kwargs), timeout=timeout, metadata=self.metadata
            )
        )

    def cancel(self, session_id: str) -> bool:
        req = generate_pb2.CancelSessionRequest(session_id=session_id)
        return self.stub.CancelSession(
            req, timeout=self.timeout_s, metadata=self.metadata
        ).cancelled

    def get_session(self, session_id: str) -> generate_pb2.SessionInfo:
        req = generate_pb2.GetSessionRequest(session_id=session_id)
        return self.stub.GetSession(req, timeout=self.timeout_s, metadata=self.metadata)

    def close_session(self, session_id: str) -> bool:
        req = generate_pb2.CloseSessionRequest(session_id=session_id)
        return self.stub.CloseSession(req, timeout=self.timeout_s, metadata=self.metadata).closed

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Stream:
    """The deltas of one GenerateStream call."""

    def __init__(self, call: Any) -> None:
        self.call = call

    def __iter__(self) -> Iterator[Delta]:
        for pb in self.call:
            yield delta(pb)

    def cancel(self) -> None:
        """Hang up: the orchestrator stops the session at its next round boundary."""
        self.call.cancel()


class AsyncClient:
    """The same calls for asyncio; ``stream`` is an async iterator."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        *,
        timeout_s: float | None = None,
        tls: ClientTls | None = None,
        api_key: str | None = None,
    ):
        """``tls``: connect over TLS (None: plaintext); ``api_key``: sent on every call."""
        self.channel = aio_channel(address, tls)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = auth_metadata(api_key)

    async def generate(self, prompt: PromptLike, **kwargs: Any) -> Completion:
        timeout = kwargs.pop("timeout_s", self.timeout_s)
        return completion(
            await self.stub.Generate(
                request(prompt, **kwargs), timeout=timeout, metadata=self.metadata
            )
        )

    async def stream(self, prompt: PromptLike, **kwargs: Any) -> AsyncIterator[Delta]:
        timeout = kwargs.pop("timeout_s", self.timeout_s)
        call = self.stub.GenerateStream(
            request(prompt, **kwargs), timeout=timeout, metadata=self.metadata
        )
        try:
            async for pb in call:
                yield delta(pb)
        finally:
            call.cancel()  # no-op once finished; hangs up if the caller stopped early

    async def cancel(self, session_id: str) -> bool:
        req = generate_pb2.CancelSessionRequest(session_id=session_id)
        return (
            await self.stub.CancelSession(req, timeout=self.timeout_s, metadata=self.metadata)
        ).cancelled

    async def get_session(self, session_id: str) -> generate_pb2.SessionInfo:
        req = generate_pb2.GetSessionRequest(session_id=session_id)
        return await self.stub.GetSession(req, timeout=self.timeout_s, metadata=self.metadata)

    async def close_session(self, session_id: str) -> bool:
        req = generate_pb2.CloseSessionRequest(session_id=session_id)
        return (
            await self.stub.CloseSession(req, timeout=self.timeout_s, metadata=self.metadata)
        ).closed

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
