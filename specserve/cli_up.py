"""What ``specserve up`` starts: each child's command-line flags and environment.

Secrets never enter a child's command line (``ps`` shows it to every user of the
machine), nor ``up``'s own when the caller follows the flags' help:

* the **Redis password** reaches the orchestrator as a file path
  (``SPECSERVE_REDIS_PASSWORD_FILE``, from ``up --redis-password-file``) or in the
  environment it inherits (``SPECSERVE_REDIS_PASSWORD``); the Redis URL, which may
  still carry one, goes in the environment too (``SPECSERVE_REDIS_URL``), and ``up``
  warns when its own ``--redis-url`` holds a password;
* without TLS, ``up`` makes a fresh **internal token**
  (:mod:`specserve.serving.internal_token`), writes it to a mode-600 file in its run
  directory and gives every child the file's path, so the replicas take calls only
  from this orchestrator. With (mutual) TLS the replicas already take only callers
  with a certificate from the CA, and no token is made.

:func:`up_children` is pure apart from writing the token file, so tests check the
very argv and environment ``up`` uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specserve.orchestrator.store.redis_settings import url_warning
from specserve.serving.cli_args import PairPlacement
from specserve.serving.internal_token import write_token_file


@dataclass(frozen=True)
class UpSettings:
    """What ``up`` was asked for, as far as its children's flags go."""

    target: str
    draft: str
    placement: PairPlacement
    threads: int | None = None
    tls_args: tuple[str, ...] = ()  # --tls-cert/--tls-key/--tls-ca for every server
    devices: str | None = None  # None: shared, or separate when the devices differ
    api_keys_file: str | None = None
    redis_url: str | None = None
    redis_password_file: str | None = None


@dataclass(frozen=True)
class UpChildren:
    """The flags of each replica and of the orchestrator (less the replicas' addresses,
    known once they bound), and the orchestrator's extra environment."""

    target_args: list[str]
    draft_args: list[str]
    orchestrator_args: list[str]
    orchestrator_env: dict[str, str] = field(repr=False)
    token_file: Path | None  # the internal token's file (None with TLS)
    warnings: list[str]  # for up's own stderr, never holding a secret


def up_children(settings: UpSettings, run_dir: Path) -> UpChildren:
    """The children's flags and environment; writes the token file into ``run_dir``."""
    at = settings.placement
    threads = ["--threads", str(settings.threads)] if settings.threads else []
    token_file = None if settings.tls_args else write_token_file(run_dir)
    common = [*threads, *settings.tls_args]
    if token_file is not None:
        common += ["--internal-token-file", str(token_file)]
    target_args = [
        *("--model", settings.target, "--device", at.target_device, "--dtype", at.target_dtype),
        *common,
    ]
    draft_args = [
        *("--model", settings.draft, "--device", at.draft_device, "--dtype", at.draft_dtype),
        *common,
    ]
    apart = at.draft_device != at.target_device
    devices = settings.devices or ("separate" if apart else "shared")
    orchestrator_args = ["--tokenizer", settings.target, "--devices", devices, *settings.tls_args]
    if token_file is not None:
        orchestrator_args += ["--internal-token-file", str(token_file)]
    if settings.api_keys_file:
        orchestrator_args += ["--api-keys-file", settings.api_keys_file]
    env: dict[str, str] = {}
    warnings: list[str] = []
    if settings.redis_url:
        env["SPECSERVE_REDIS_URL"] = settings.redis_url  # may hold a password: not argv
        warning = url_warning(settings.redis_url, "--redis-url")
        if warning is not None:
            warnings.append(warning)
    if settings.redis_password_file:
        env["SPECSERVE_REDIS_PASSWORD_FILE"] = settings.redis_password_file
    return UpChildren(target_args, draft_args, orchestrator_args, env, token_file, warnings)
