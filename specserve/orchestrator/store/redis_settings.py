"""How to reach Redis: a dataclass built from a ``redis://`` or ``rediss://`` URL.

``rediss://`` (or ``tls=True``) turns TLS on; a CA bundle, a client certificate
and key, and hostname checking are separate options because URLs cannot carry
files. A password given as an option wins over one in the URL, so the URL can be
logged or put in a manifest while the password comes from a secret: a file
(``--redis-password-file``, e.g. a mounted Kubernetes Secret) or the environment
(``SPECSERVE_REDIS_PASSWORD``). A password on the command line — ``--redis-password``
or inside ``--redis-url`` — still works but warns (:func:`password_from`,
:func:`url_warning`): every user of the machine can read a process's command line.
No message shows a password (:func:`redacted`). With no URL at all the orchestrator
uses an embedded store (:func:`embedded_client`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from specserve.engine.errors import InvalidArgument

DEFAULT_PORT = 6379


@dataclass(frozen=True)
class RedisSettings:
    """Connection settings for one Redis server (the password never appears in repr)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_check_hostname: bool = True
    connect_timeout_s: float = 5.0
    socket_timeout_s: float = 5.0
    retries: int = 3  # per call, on connection errors and timeouts (the store's scripts are
    # idempotent, so a retried write whose first reply was lost is safe)

    def __post_init__(self) -> None:
        if not self.host:
            raise InvalidArgument("the Redis URL names no host")
        if not 0 < self.port < 65536:
            raise InvalidArgument(f"the Redis port must be in 1..65535, got {self.port}")
        if self.db < 0:
            raise InvalidArgument(f"the Redis database must be >= 0, got {self.db}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise InvalidArgument(
                "a TLS client certificate needs its key, and a key its certificate"
            )
        if self.connect_timeout_s <= 0 or self.socket_timeout_s <= 0:
            raise InvalidArgument("Redis timeouts must be > 0 seconds")

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> RedisSettings:
        """Parse ``redis[s]://[[user]:password@]host[:port][/db]``; ``overrides`` win.

        An override of ``None`` keeps what the URL says (so unset CLI flags pass through).
        """
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise InvalidArgument(
                f"a Redis URL starts with redis:// or rediss:// (TLS), got {url.split('://')[0]!r}"
            )
        try:
            port = parts.port or DEFAULT_PORT
        except ValueError:
            raise InvalidArgument("the Redis URL has a port that is not a number") from None
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise InvalidArgument(f"the Redis database in the URL must be a number, got {path!r}")
        settings = cls(
            host=parts.hostname or "",
            port=port,
            db=int(path) if path else 0,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
            tls=parts.scheme == "rediss",
        )
        given = {k: v for k, v in overrides.items() if v is not None}
        return replace(settings, **given) if given else settings

    @property
    def display(self) -> str:
        """Where this points, without credentials (for logs)."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{self.host}:{self.port}/{self.db}"

    def client(self) -> Any:
        """A ``redis.asyncio.Redis`` client for these settings (connects lazily; hiredis
        packs its commands and parses its replies, :mod:`.redis_packing`)."""
        import redis.asyncio
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff

        from specserve.orchestrator.store.redis_packing import use_hiredis_packing

        kwargs: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "db": self.db,
            "username": self.username,
            "password": self.password,
            "socket_connect_timeout": self.connect_timeout_s,
            "socket_timeout": self.socket_timeout_s,
            "decode_responses": False,
            "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), self.retries),
        }
        if self.tls:
            kwargs.update(
                ssl=True,
                ssl_ca_certs=self.tls_ca_file,
                ssl_certfile=self.tls_cert_file,
                ssl_keyfile=self.tls_key_file,
                ssl_check_hostname=self.tls_check_hostname,
                ssl_cert_reqs="required",
            )
        return use_hiredis_packing(redis.asyncio.Redis(**kwargs))


def embedded_client() -> Any:
    """An in-process Redis (fakeredis with Lua) for a single orchestrator without a server."""
    import fakeredis

    return fakeredis.FakeAsyncRedis()


def url_has_password(url: str) -> bool:
    """Whether a Redis URL carries a password (``redis://:secret@host``)."""
    try:
        return urlsplit(url).password is not None
    except ValueError:
        return False


def redacted(url: str) -> str:
    """The URL with any password replaced by ``***`` (for messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def password_from(
    *, flag: str | None, file: str | None, env: str | None
) -> tuple[str | None, list[str]]:
    """The Redis password from ``--redis-password`` (discouraged), ``--redis-password-file``
    or the environment, in that order, and the warnings to log (never holding it).

    A file's trailing newline is dropped. InvalidArgument when both flag and file are given
    or the file cannot be read; the message never holds the password.
    """
    warnings: list[str] = []
    if flag and file:
        raise InvalidArgument("give the Redis password by --redis-password-file, not both flags")
    if flag:
        warnings.append(
            "--redis-password puts the password in the process list (ps, /proc/<pid>/cmdline) "
            "for every user of this machine; use --redis-password-file or "
            "SPECSERVE_REDIS_PASSWORD instead"
        )
        return flag, warnings
    if file:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except OSError as e:
            raise InvalidArgument(
                f"cannot read --redis-password-file {file!r}: {e.strerror}"
            ) from None
        password = text.rstrip("\r\n")
        if not password:
            raise InvalidArgument(f"--redis-password-file {file!r} is empty")
        return password, warnings
    return env or None, warnings


def url_warning(url: str, flag: str) -> str | None:
    """The warning for a password inside a Redis URL given by ``flag`` (None: it has none)."""
    if not url_has_password(url):
        return None
    return (
        f"the {flag} URL carries a password, which shows in the process list and in every "
        f"copy of the command line ({redacted(url)}); leave it out of the URL and use "
        "--redis-password-file or SPECSERVE_REDIS_PASSWORD"
    )
