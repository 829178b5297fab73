"""Bearer API keys of the public API: the ``--api-keys-file`` format, checking a caller.

A caller sends gRPC metadata ``authorization: Bearer <key>`` (what an HTTP front door
forwards from its ``Authorization`` header). The keys file holds one key per line::

    # comments and blank lines are ignored
    2f6c0c1e9b7d4a58a1e3c6b0d9f4e7a2                  # every operation
    b91d7e20c4a34f6f8e5a0c2d1b3f9e87  generate         # Generate / GenerateStream only
    5a0e3c9d7b2f4e6a8c1d0b9f3e7a2c64  sessions         # the session RPCs only

A key is 16 to 512 characters of ``A-Z a-z 0-9 - . _ ~ + / =`` (RFC 6750's token68);
after it, optionally, a comma-separated list of scopes (``generate``, ``sessions``);
none means all. Text after ``#`` is a comment.

* no ``authorization`` metadata, or one that is not ``Bearer <key>``: UNAUTHENTICATED;
* a key not in the file: UNAUTHENTICATED;
* a key whose scopes do not include the method's: PERMISSION_DENIED.

Health and reflection need no key (Kubernetes probes call health without one).
The file is read again when it changes (:class:`KeysFile`, checked at most every
``RELOAD_CHECK_S`` seconds), so a key is added or revoked without a restart; a file
that no longer parses keeps the keys in force and logs why.
Keys are never stored or logged: a caller is known by its key's SHA-256
(:attr:`Caller.fingerprint`), which a session record keeps as its owner, and in logs
by the first 8 hex digits of it (:attr:`Caller.key_id`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from specserve.engine.errors import InvalidArgument
from specserve.serving.internal_token import refusing

log = logging.getLogger(__name__)

RELOAD_CHECK_S = 2.0
SCOPES = frozenset({"generate", "sessions"})
# The scope each method of the public Generation service needs.
METHOD_SCOPES = {
    "Generate": "generate",
    "GenerateStream": "generate",
    "GetSession": "sessions",
    "CancelSession": "sessions",
    "CloseSession": "sessions",
}
PROTECTED_SERVICE = "/specserve.v1.Generation/"
_KEY = re.compile(r"[A-Za-z0-9\-._~+/=]{16,512}")
_BEARER = re.compile(r"Bearer +(\S+) *", re.IGNORECASE)


def fingerprint(key: str) -> bytes:
    """The SHA-256 of a key: how a caller is stored and compared, never the key itself."""
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Caller:
    """An authenticated caller."""

    fingerprint: bytes  # SHA-256 of the key
    scopes: frozenset[str]

    @property
    def key_id(self) -> str:
        """A short, non-secret name of the key for logs."""
        return self.fingerprint.hex()[:8]


class Refused(Exception):
    """A call the keys do not allow: ``code`` is UNAUTHENTICATED or PERMISSION_DENIED."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ApiKeys:
    """The keys of one ``--api-keys-file``, by fingerprint."""

    def __init__(self, callers: Iterable[Caller]) -> None:
        self.by_fingerprint = {c.fingerprint: c for c in callers}

    def __len__(self) -> int:
        return len(self.by_fingerprint)

    @classmethod
    def parse(cls, text: str, where: str = "the API keys file") -> ApiKeys:
        """Parse the file's text (InvalidArgument names the line; never echoes a key)."""
        callers: list[Caller] = []
        seen: set[bytes] = set()
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            key, *rest = line.split(None, 1)
            if not _KEY.fullmatch(key):
                raise InvalidArgument(
                    f"{where} line {number}: a key is 16 to 512 characters of letters, digits "
                    "and - . _ ~ + / ="
                )
            scopes = frozenset(s.strip() for s in rest[0].split(",")) if rest else SCOPES
            unknown = scopes - SCOPES
            if unknown or not scopes:
                raise InvalidArgument(
                    f"{where} line {number}: unknown scope {sorted(unknown)[0]!r} "
                    f"(known: {', '.join(sorted(SCOPES))})"
                )
            fp = fingerprint(key)
            if fp in seen:
                raise InvalidArgument(f"{where} line {number}: the same key is listed twice")
            seen.add(fp)
            callers.append(Caller(fp, scopes))
        if not callers:
            raise InvalidArgument(f"{where} lists no key: every call would be refused")
        return cls(callers)

    @classmethod
    def load(cls, path: str) -> ApiKeys:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise InvalidArgument(f"cannot read --api-keys-file {path!r}: {e.strerror}") from None
        return cls.parse(text, f"--api-keys-file {path!r}")

    def authenticate(self, metadata: Iterable[tuple[str, Any]] | None, method: str) -> Caller:
        """The caller of ``method`` (a public method name), or :class:`Refused`."""
        header = bearer_header(metadata)
        if header is None:
            raise Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                "this call needs an API key: send metadata 'authorization: Bearer <key>'",
            )
        m = _BEARER.fullmatch(header)
        if m is None:
            raise Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                "the 'authorization' metadata must be 'Bearer <key>'",
            )
        caller = self.by_fingerprint.get(fingerprint(m.group(1)))
        if caller is None:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "the API key is not valid")
        scope = METHOD_SCOPES.get(method)
        if scope is None or scope not in caller.scopes:
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"API key {caller.key_id} may not call {method} "
                f"(it needs scope {scope!r}; the key has {', '.join(sorted(caller.scopes))})",
            )
        return caller


class KeysFile:
    """An ``--api-keys-file`` and the keys it held when last read; re-read when it changes."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self._stamp = self._stat()
        self.keys = ApiKeys.load(path)
        self._checked = clock()

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)
        except OSError:
            return (0, 0, 0)
        return (st.st_mtime_ns, st.st_size, st.st_ino)  # a Secret update swaps the file

    def current(self) -> ApiKeys:
        """The keys in force: the file's as last read, re-read if it changed since."""
        now = self.clock()
        if now - self._checked < RELOAD_CHECK_S:
            return self.keys
        self._checked = now
        stamp = self._stat()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self.keys = ApiKeys.load(self.path)
                log.info("API keys reloaded: %d keys", len(self.keys))
            except InvalidArgument as e:
                log.error("keeping the %d API keys in force: %s", len(self.keys), e)
        return self.keys


def bearer_header(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The value of the ``authorization`` metadata (None when absent or binary)."""
    for name, value in metadata or ():
        if name == "authorization" and isinstance(value, str):
            return value
    return None


def owner_of(keys: KeysFile | None, metadata: Iterable[tuple[str, Any]] | None) -> bytes:
    """The fingerprint a call's sessions belong to: b"" with no keys configured. Called by
    the servicer after :class:`AuthInterceptor` let the call in, so the key is valid."""
    if keys is None:
        return b""
    m = _BEARER.fullmatch(bearer_header(metadata) or "")
    assert m is not None, "the interceptor lets no call without a bearer key through"
    return fingerprint(m.group(1))


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the Generation service without a valid key for the method;
    every other service (health, reflection) passes untouched."""

    def __init__(self, keys: KeysFile) -> None:
        self.keys = keys

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not method.startswith(PROTECTED_SERVICE):
            return handler
        try:
            self.keys.current().authenticate(
                handler_call_details.invocation_metadata, method.removeprefix(PROTECTED_SERVICE)
            )
        except Refused as refused:
            return refusing(handler, refused.code, str(refused))
        return handler
