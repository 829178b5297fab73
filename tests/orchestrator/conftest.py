"""Fixtures of the orchestrator tests: a real Redis server, and stores on it or on fakeredis.

The suite has no asyncio plugin: async tests are plain functions that call
``asyncio.run``; a store is made inside that loop by the ``make_store`` factory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import fakeredis
import pytest

from specserve.orchestrator.store.redis_settings import RedisSettings
from specserve.orchestrator.store.session_store import SessionStore, StoreTtls
from tests.orchestrator.byte_tokenizer import write_byte_tokenizer
from tests.orchestrator.redis_server import redis_server
from tests.orchestrator.stack import Reference, Stack

StoreFactory = Callable[..., SessionStore]


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server for the whole test session (tests using it are marked redis)."""
    with redis_server() as url:
        yield url


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.redis)])
def make_store(request: pytest.FixtureRequest) -> StoreFactory:
    """Builds a SessionStore on fakeredis or on the real Redis server (call inside the loop).

    Real-Redis stores share one server; tests use unique session ids and compare key
    sets before and after rather than assuming an empty database.
    """
    if request.param == "fake":
        server = fakeredis.FakeServer()  # stores made by one test share it, like a real server
        return lambda ttls=None: SessionStore(
            fakeredis.FakeAsyncRedis(server=server), ttls, where="embedded store"
        )
    url = request.getfixturevalue("redis_url")
    return lambda ttls=None: SessionStore(
        RedisSettings.from_url(url).client(), ttls or StoreTtls(), where="redis"
    )


@pytest.fixture(scope="session")
def stack(redis_url: str) -> Iterator[Stack]:
    """One target, one draft and an orchestrator on the real Redis (shared by the session)."""
    s = Stack(redis_url)
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture
def two_targets(redis_url: str) -> Iterator[Stack]:
    """Two target replicas, one draft and an orchestrator: the failover tests' stack."""
    s = Stack(redis_url, targets=2)
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="session")
def small_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack whose target's KV budget is 2 MiB (4,096 tiny-model tokens) and whose
    orchestrator has a byte-level tokenizer (text prompts): the admission tests' stack."""
    tokenizer = write_byte_tokenizer(tmp_path_factory.mktemp("byte-tokenizer"))
    s = Stack(
        redis_url,
        orchestrator_args=["--tokenizer", str(tokenizer)],
        target_args=[["--kv-budget", "2MiB"]],
    )
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="session")
def reference() -> Reference:
    return Reference()
