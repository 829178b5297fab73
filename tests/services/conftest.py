"""Draft and target servers in child processes on loopback ports, shared by the service tests.

Every server runs a tiny random model with one torch thread. Session ids are
unique per test (see :func:`sid`) so tests can share servers.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Iterator
from typing import TypeVar

import grpc
import pytest

from specserve.serving.launch import ServerProcess
from specserve.v1 import draft_pb2_grpc, target_pb2_grpc

TARGET = "tiny:3"
DRAFT = "tiny:3:noise=0.3"
# float32 for the draft too (its server's default is bfloat16): sampled rounds are
# compared draw for draw with an in-process engine on the float32 tiny models.
COMMON = ["--threads", "1", "--kv-budget", "8MiB", "--dtype", "float32"]

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def sid(prefix: str = "s") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def start_all(*servers: ServerProcess) -> None:
    """Spawn every server, then wait for all (their start-ups overlap)."""
    for s in servers:
        s.start()
    for s in servers:
        s.wait_serving()


@pytest.fixture(scope="session")
def pair() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(target, draft): the shared pair every read-mostly test talks to."""
    target = ServerProcess("target", ["--model", TARGET, *COMMON])
    draft = ServerProcess("draft", ["--model", DRAFT, *COMMON])
    try:
        start_all(target, draft)
        yield target, draft
    finally:
        target.stop()
        draft.stop()


class Stubs:
    """Async stubs for a (target, draft) pair on fresh channels; use with ``async with``."""

    def __init__(self, target: ServerProcess, draft: ServerProcess) -> None:
        self._channels = [grpc.aio.insecure_channel(s.address) for s in (target, draft)]
        self.target = target_pb2_grpc.TargetServiceStub(self._channels[0])
        self.draft = draft_pb2_grpc.DraftServiceStub(self._channels[1])

    async def __aenter__(self) -> Stubs:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for channel in self._channels:
            await channel.close()
