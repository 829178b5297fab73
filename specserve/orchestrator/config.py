"""The orchestrator's configuration: one frozen dataclass, built once from flags.

The flags and their ``SPECSERVE_*`` environment defaults are defined in
:mod:`specserve.orchestrator.flags` (read there, while the parser is built, and
nowhere deeper); :func:`from_args` turns the parsed flags into an
:class:`OrchestratorConfig`, refusing a bad value with a sentence.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace

from specserve.orchestrator.api.admission import AdmissionConfig
from specserve.orchestrator.api.api_keys import ApiKeys
from specserve.orchestrator.flags import DEFAULT_PORT, add_arguments
from specserve.orchestrator.fleet.replicas import EndpointSpec
from specserve.orchestrator.fleet.scheduler import SchedulerConfig
from specserve.orchestrator.round.calls import RoundTimeouts
from specserve.orchestrator.snapshots.kv_snapshots import SnapshotConfig
from specserve.orchestrator.store.redis_settings import RedisSettings, password_from, url_warning
from specserve.orchestrator.store.session_store import StoreTtls
from specserve.orchestrator.store.store_retry import DEFAULT_WINDOW_S as DEFAULT_REDIS_RETRY_S
from specserve.policy import Devices, PolicyConfig, with_overrides
from specserve.serving.cli_args import flag_values
from specserve.serving.internal_token import internal_token
from specserve.serving.server import ServerOptions
from specserve.serving.tls import (
    LOOPBACK_HOSTS,
    ClientTls,
    client_tls,
    server_tls,
)
from specserve.telemetry.config import telemetry_config

__all__ = ["DEFAULT_PORT", "OrchestratorConfig", "add_arguments", "from_args"]


@dataclass(frozen=True)
class OrchestratorConfig:
    """Everything an orchestrator process needs."""

    targets: EndpointSpec
    drafts: EndpointSpec = field(default_factory=EndpointSpec)
    redis: RedisSettings | None = None  # None = the embedded store
    tokenizer: str | None = None  # model whose tokenizer serves text prompts
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    timeouts: RoundTimeouts = field(default_factory=RoundTimeouts)
    ttls: StoreTtls = field(default_factory=StoreTtls)
    redis_retry_s: float = DEFAULT_REDIS_RETRY_S  # transient Redis errors retried this long
    dns_refresh_s: float = 10.0
    served_model_name: str | None = None  # gen_ai.request.model; None = the tokenizer's spec
    snapshots: SnapshotConfig = field(default_factory=SnapshotConfig)
    snapshot_redis: RedisSettings | None = None  # None = the session store's Redis
    server: ServerOptions = field(
        default_factory=lambda: ServerOptions(port=DEFAULT_PORT, data_port=None)
    )
    replica_tls: ClientTls | None = None  # None = plaintext channels to the replicas
    api_keys_file: str | None = None  # None = the public API takes calls without a key
    # sent on every call to the replicas (specserve.serving.internal_token); None = none
    internal_token: str | None = field(default=None, repr=False)
    warnings: tuple[str, ...] = ()  # about unsafe settings, logged once logging is set up

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("the orchestrator needs at least one target endpoint (--target)")
        if self.dns_refresh_s <= 0:
            raise ValueError("dns_refresh_s must be > 0")
        if self.redis_retry_s < 0:
            raise ValueError("--redis-retry-s must be >= 0")

    @property
    def metrics_port(self) -> int | None:
        """Where Prometheus metrics are served (None = nowhere; 0 = any free port)."""
        return self.server.telemetry.metrics_port

    @property
    def model_name(self) -> str:
        """The model requests are said to be made to (traces' ``gen_ai.request.model``)."""
        return self.served_model_name or self.tokenizer or "specserve"


def policy_config(args: argparse.Namespace) -> PolicyConfig:
    """The scheduling policy the flags describe, ``--policy`` overrides applied last."""
    if args.devices not in ("separate", "shared"):  # argparse does not check an env default
        raise ValueError(f"--devices must be one of separate, shared, got {args.devices!r}")
    base = PolicyConfig(
        devices=args.devices,
        k_max=args.k_max,
        curve_full_below=args.k_full_below,
        curve_zero_at=args.k_zero_at,
        plain_steps=args.plain_steps,
    )
    return with_overrides(base, args.policy or "")


# How long an idle lane waits for company before its first round, by declared devices,
# in ms. On shared CPU cores a prefill round takes about a second, and a request that
# misses it waits that long; on accelerators a round takes 6-25 ms, so a lone request
# would pay a 10 ms wait every time for what at most one round saves.
ADMISSION_WINDOW_MS = {Devices.SHARED: 10.0, Devices.SEPARATE: 2.0}


@flag_values("orchestrator")
def from_args(args: argparse.Namespace) -> OrchestratorConfig:
    """The config the parsed flags describe."""
    password, warnings = password_from(
        flag=args.redis_password, file=args.redis_password_file, env=args.redis_password_env
    )
    for url, flag in (
        (args.redis_url, "--redis-url"),
        (args.kv_snapshot_redis_url, "--kv-snapshot-redis-url"),
    ):
        warning = url_warning(url or "", flag)
        if warning:
            warnings.append(warning)
    redis = None
    if args.redis_url:
        redis = RedisSettings.from_url(
            args.redis_url,
            password=password,
            tls_ca_file=args.redis_tls_ca,
            tls_cert_file=args.redis_tls_cert,
            tls_key_file=args.redis_tls_key,
            tls_check_hostname=False if args.redis_tls_no_verify_hostname else None,
        )
    snapshot_redis = None
    if args.kv_snapshot_redis_url:
        snapshot_redis = RedisSettings.from_url(args.kv_snapshot_redis_url)
        if snapshot_redis.password is None and password is not None:
            snapshot_redis = replace(snapshot_redis, password=password)  # the store's
    tls = server_tls(args, check_clients=False)
    replica_tls = client_tls(args)
    if tls is not None and replica_tls is None:
        warnings.append(
            "the public API serves TLS but the channels to the replicas are plaintext: give "
            "--tls-ca (the CA of the replicas' certificates) to encrypt them too"
        )
    if not args.api_keys_file and args.host not in LOOPBACK_HOSTS:
        warnings.append(
            f"the public API listens on {args.host} without --api-keys-file: anyone who "
            "reaches it can generate, and read or close any session whose id they learn"
        )
    if args.api_keys_file:
        ApiKeys.load(args.api_keys_file)  # a bad file is a flag error now, not at the first call
    token = internal_token(args)
    policy = policy_config(args)
    return OrchestratorConfig(
        targets=EndpointSpec.parse(args.target or "", "target"),
        drafts=EndpointSpec.parse(args.draft or "", "draft"),
        redis=redis,
        tokenizer=args.tokenizer or None,
        scheduler=SchedulerConfig(
            max_batch=args.max_batch,
            max_prefill_tokens=args.max_prefill_tokens,
            admission_window_s=(
                ADMISSION_WINDOW_MS[policy.devices]
                if args.admission_window_ms is None
                else args.admission_window_ms
            )
            / 1000,
        ),
        policy=policy,
        admission=AdmissionConfig(
            max_prompt_tokens=args.max_prompt_tokens,
            max_prompt_bytes=args.max_prompt_bytes,
            max_stop_strings=args.max_stop_strings,
            max_stop_bytes=args.max_stop_bytes,
            max_stop_total_bytes=args.max_stop_total_bytes,
        ),
        timeouts=RoundTimeouts(
            draft_s=args.draft_timeout_s,
            target_s=args.target_timeout_s,
            failover_s=args.failover_s,
            stall_s=args.target_stall_s,
        ),
        ttls=StoreTtls(session_s=args.session_ttl_s, lease_s=args.session_lease_s),
        redis_retry_s=args.redis_retry_s,
        dns_refresh_s=args.dns_refresh_s,
        served_model_name=args.served_model_name or None,
        snapshots=SnapshotConfig(
            enabled=args.kv_snapshots,
            chunk_tokens=args.kv_snapshot_chunk_tokens,
            every_chunks=args.kv_snapshot_every,
            ttl_s=args.kv_snapshot_ttl_s,
            timeout_s=args.target_timeout_s,
        ),
        snapshot_redis=snapshot_redis,
        server=ServerOptions(
            host=args.host,
            port=args.port,
            port_file=args.port_file,
            grace_s=args.grace_s,
            replica_id=args.replica_id,
            tls=tls,
            health_port=args.health_port,
            data_port=None,  # the orchestrator has no data plane of its own
            telemetry=telemetry_config(args),
        ),
        replica_tls=replica_tls,
        api_keys_file=args.api_keys_file or None,
        internal_token=token,
        warnings=tuple(warnings),
    )
