"""RedisSettings: URL parsing, overrides, TLS options, and a password-protected server."""

from __future__ import annotations

import asyncio

import pytest

from specserve.engine.errors import InvalidArgument
from specserve.orchestrator.store.redis_settings import RedisSettings
from specserve.orchestrator.store.session_store import SessionStore
from specserve.serving.errors import Unavailable
from tests.orchestrator.redis_server import redis_server


def test_url_parts() -> None:
    s = RedisSettings.from_url("redis://user:p%40ss@cache.example:6380/2")
    assert (s.host, s.port, s.db, s.username, s.password, s.tls) == (
        "cache.example",
        6380,
        2,
        "user",
        "p@ss",
        False,
    )
    assert "p@ss" not in repr(s) and "p@ss" not in s.display
    assert RedisSettings.from_url("redis://h").port == 6379


def test_tls_and_overrides() -> None:
    s = RedisSettings.from_url(
        "rediss://:inurl@h:1/0", password="fromsecret", tls_ca_file="ca.pem", username=None
    )
    assert s.tls and s.password == "fromsecret" and s.tls_ca_file == "ca.pem"
    assert s.display.startswith("rediss://")
    client = s.client()
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["ssl_ca_certs"] == "ca.pem" and kwargs["password"] == "fromsecret"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("http://h", "redis://"),
        ("redis://h:x", "port"),
        ("redis://h/abc", "database"),
        ("redis://", "host"),
    ],
)
def test_bad_urls(url: str, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        RedisSettings.from_url(url)


def test_cert_needs_key() -> None:
    with pytest.raises(InvalidArgument, match="key"):
        RedisSettings(tls=True, tls_cert_file="c.pem")


@pytest.mark.redis
def test_password_protected_server() -> None:
    with redis_server(password="s3cret") as url:
        bare = url.replace(":s3cret@", "")

        async def body() -> None:
            ok = SessionStore(RedisSettings.from_url(bare, password="s3cret").client())
            await ok.ping()
            await ok.close()
            refused = SessionStore(RedisSettings.from_url(bare).client())
            with pytest.raises(Unavailable):
                await refused.ping()
            await refused.close()

        asyncio.run(body())
