"""The tests' redis-server: :mod:`specserve.devtools.redis_server`, skipping where absent."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from specserve.devtools.ports import free_port
from specserve.devtools.redis_server import throwaway_redis

__all__ = ["free_port", "redis_server"]


@contextmanager
def redis_server(password: str | None = None) -> Iterator[str]:
    """Start redis-server; yields its URL. Skips the caller's test when it is not installed."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (bash scripts/ensure-redis.sh)")
    with throwaway_redis(password) as url:
        yield url
