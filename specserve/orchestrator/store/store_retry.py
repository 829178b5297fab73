"""Riding out a Redis outage: transient errors retried with backoff inside a bounded window.

A Redis restart, a failover or a dropped connection refuses calls for a few
seconds. Every call of the session store goes through :meth:`RetryWindow.call`:
a connection error, a timeout or ``LOADING`` (Redis reading its data back) is
retried with exponential backoff until ``window_s`` has passed since the first
attempt; then, and on any other error at once, the caller gets
:class:`~specserve.serving.errors.Unavailable`. Retrying is safe because every
write is an idempotent script (:mod:`specserve.orchestrator.store.store_scripts`).
A round whose commit is being retried simply waits: its stream pauses and goes
on once Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    ReadOnlyError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specserve.serving.errors import Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

# BusyLoadingError (Redis is loading its data after a restart) is a ConnectionError;
# ReadOnlyError, TryAgainError and ClusterDownError come during a replica's promotion.
TRANSIENT: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ReadOnlyError,
    TryAgainError,
    ClusterDownError,
    OSError,
    asyncio.TimeoutError,
)
# ConnectionErrors that no wait mends: a wrong password or a missing permission.
PERMANENT: tuple[type[BaseException], ...] = (AuthenticationError, AuthorizationError)
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
# How long calls are retried by default (--redis-retry-s).
DEFAULT_WINDOW_S = 10.0


class RetryWindow:
    """Retries transient failures of one store for up to ``window_s`` seconds a call."""

    def __init__(
        self,
        what: str,
        window_s: float = DEFAULT_WINDOW_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s < 0:
            raise ValueError("the Redis retry window must be >= 0 seconds")
        self.what = what  # "the session store (redis://...)", for messages
        self.window_s = window_s
        self.clock = clock
        self.retried = 0  # calls that failed at least once and were sent again

    async def call(self, attempt: Callable[[], Awaitable[T]], *, retry: bool = True) -> T:
        """``await attempt()``, again on transient errors while the window lasts.

        ``attempt`` builds a fresh call each time (a pipeline cannot be re-sent).
        ``retry=False``: one attempt (probes such as a ping at start-up).
        """
        give_up = self.clock() + (self.window_s if retry else 0.0)
        backoff = FIRST_BACKOFF_S
        failed = False
        while True:
            try:
                result = await attempt()
            except PERMANENT as e:
                raise Unavailable(f"{self.what} refused this client: {e}") from e
            except TRANSIENT as e:
                left = give_up - self.clock()
                if left <= 0:
                    raise Unavailable(self._why(e, retry and self.window_s > 0)) from e
                if not failed:
                    failed = True
                    self.retried += 1
                    log.warning(
                        "%s failed (%s); retrying for up to %.1f s", self.what, _name(e), left
                    )
                await asyncio.sleep(min(backoff, left))
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            except RedisError as e:
                raise Unavailable(f"{self.what} failed: {e}") from e
            if failed:
                log.warning("%s answers again", self.what)
            return result

    def _why(self, e: BaseException, retried: bool) -> str:
        tail = f" for {self.window_s:g} s" if retried else ""  # retried: within the window
        return f"{self.what} is unreachable{tail}: {_name(e)}"


def _name(e: Any) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
