"""Requests whose bytes do not parse as the method's message: INVALID_ARGUMENT, one WARNING.

gRPC parses a request before the handler runs; a parse error escaping there is
answered ``UNKNOWN`` with an ERROR traceback in the log, per call: a cheap log
flood for anyone who can open a connection. :func:`tolerant` wraps a method's
deserializer so that bytes that do not parse become a :class:`Malformed` value
instead (and, where the method has a byte limit, more bytes than it an
:class:`Oversized` one, refused without parsing); the error interceptor
answers it with :func:`refuse` (``INVALID_ARGUMENT`` and a sentence) and logs
through :class:`RateLimitedWarning` (one line per ``interval_s`` for the whole
process, with the count of calls it stands for).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

log = logging.getLogger(__name__)

WARNING_INTERVAL_S = 10.0


@dataclass(frozen=True)
class Malformed:
    """What a request that did not parse is handed to the handler as."""

    message: str  # the full name of the expected message
    size: int  # bytes received
    why: str  # the parser's complaint


@dataclass(frozen=True)
class Oversized:
    """What a request larger than its method's byte limit is handed to the handler as
    (never parsed: parsing 10 MB takes the event loop 25-70 ms here)."""

    size: int
    limit: int


def tolerant(
    deserialize: Callable[[bytes], Any] | None, max_bytes: int | None = None
) -> Callable[[bytes], Any] | None:
    """``deserialize``, returning :class:`Malformed` instead of raising, and
    :class:`Oversized` for more than ``max_bytes`` (None: no limit but the transport's)."""
    if deserialize is None:
        return None
    owner = getattr(deserialize, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    name = getattr(descriptor, "full_name", "the method's request message")

    def parse(data: bytes) -> Any:
        if max_bytes is not None and len(data) > max_bytes:
            return Oversized(len(data), max_bytes)
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, or anything a custom parser raises
            return Malformed(name, len(data), f"{type(e).__name__}: {e}"[:200])

    return parse


class RateLimitedWarning:
    """One WARNING line per ``interval_s`` (any thread), counting the calls in between."""

    def __init__(self, logger: logging.Logger, interval_s: float = WARNING_INTERVAL_S) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._suppressed = 0

    def warn(self, text: str) -> bool:
        """Log ``text`` unless a line went out less than ``interval_s`` ago; whether it did."""
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                self._suppressed += 1
                return False
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        more = f" (and {suppressed} more since the last such line)" if suppressed else ""
        self.logger.warning("%s%s", text, more)
        return True


_warning = RateLimitedWarning(log)


async def refuse(
    method: str, request: Malformed | Oversized, context: grpc.aio.ServicerContext
) -> None:
    """Answer a malformed or oversized request INVALID_ARGUMENT (raises ``AbortError``,
    as abort does); only a malformed one is logged (rate-limited)."""
    if isinstance(request, Oversized):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is {request.size} bytes; this method accepts at most "
            f"{request.limit} (see the prompt and stop-string limits)",
        )
    peer = context.peer() if hasattr(context, "peer") else "?"
    _warning.warn(
        f"{method}: refused a request of {request.size} bytes from {peer} that is not a "
        f"{request.message} ({request.why})"
    )
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request ({request.size} bytes) does not parse as a {request.message} message: "
        "send a serialized message of the method's request type",
    )
