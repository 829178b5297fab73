"""The orchestrator's flags: what an operator sets, and its environment defaults.

Every flag has a ``SPECSERVE_*`` environment default (read here, while the
parser is built, and nowhere deeper); :func:`specserve.orchestrator.config.from_args`
turns the parsed flags into the process's one frozen config:

==============================  ===============================  ======================
flag                            environment                      default
==============================  ===============================  ======================
``--draft``                     ``SPECSERVE_DRAFT_ENDPOINTS``    none (target-only)
``--target``                    ``SPECSERVE_TARGET_ENDPOINTS``   required
``--redis-url``                 ``SPECSERVE_REDIS_URL``          embedded store
``--redis-password-file``       ``SPECSERVE_REDIS_PASSWORD_FILE``  from the URL
(password itself)               ``SPECSERVE_REDIS_PASSWORD``     from the URL
``--redis-password``            (none: warns, process list)      from the URL
``--redis-tls-ca``              ``SPECSERVE_REDIS_TLS_CA``        system CAs
``--redis-tls-cert/-key``       ``SPECSERVE_REDIS_TLS_CERT/KEY``  none
``--redis-retry-s``             ``SPECSERVE_REDIS_RETRY_S``      10 (transient errors)
``--session-lease-s``           ``SPECSERVE_SESSION_LEASE_S``    5
``--target-stall-s``            ``SPECSERVE_TARGET_STALL_S``     5 (a hung target)
``--target-timeout-s``          ``SPECSERVE_TARGET_TIMEOUT_S``   60 (a Verify's least budget)
``--tokenizer``                 ``SPECSERVE_TOKENIZER``          none (token ids only)
``--host`` / ``--port``         ``SPECSERVE_HOST`` / ``_PORT``   127.0.0.1 / 50051
``--served-model-name``         ``SPECSERVE_SERVED_MODEL_NAME``  the tokenizer's model
``--kv-snapshots``              ``SPECSERVE_KV_SNAPSHOTS``       off
``--kv-snapshot-redis-url``     ``SPECSERVE_KV_SNAPSHOT_REDIS_URL``  the session store
``--tls-cert`` / ``--tls-key``  ``SPECSERVE_TLS_CERT`` / ``_KEY``  plaintext
``--tls-ca``                    ``SPECSERVE_TLS_CA``             plaintext to replicas
``--tls-server-name``           ``SPECSERVE_TLS_SERVER_NAME``    the host dialled
``--api-keys-file``             ``SPECSERVE_API_KEYS_FILE``      none (no key needed)
``--internal-token-file``       ``SPECSERVE_INTERNAL_TOKEN_FILE``  none (no token sent)
``--health-port``               ``SPECSERVE_HEALTH_PORT``        none (plaintext health)
==============================  ===============================  ======================

Security (``docs/security.md``): ``--tls-cert``/``--tls-key`` serve the public API over
TLS and are the client certificate presented to the replicas; ``--tls-ca`` turns on
TLS towards the replicas and is the CA their certificates must chain to;
``--api-keys-file`` makes every public call carry a bearer key
(:mod:`specserve.orchestrator.api.api_keys`); ``--internal-token-file`` (or the token in
``SPECSERVE_INTERNAL_TOKEN``) is the deployment's internal token, sent on every call to
the replicas (:mod:`specserve.serving.internal_token`). Secrets come from files or the environment:
a password on the command line works but warns (``warnings``, logged at start).

the admission bounds (``--max-prompt-tokens``, ``--max-prompt-bytes``,
``--max-stop-strings``, ``--max-stop-bytes``, ``--max-stop-total-bytes``; see
:mod:`specserve.orchestrator.api.admission`), the scheduling knobs below (``--k-max``,
``--k-full-below``, ``--k-zero-at``,
``--max-batch``, ``--max-prefill-tokens``,
``--admission-window-ms``, ``--devices``, ``--plain-steps``, ``--policy``,
``--draft-timeout-s``, ...), the KV
snapshot ones (``--kv-snapshot-chunk-tokens``, ``--kv-snapshot-every``,
``--kv-snapshot-ttl-s``; see :mod:`specserve.orchestrator.snapshots.kv_snapshots`), and the
telemetry flags every server takes (:mod:`specserve.telemetry.config`: tracing,
logs, ``--metrics-port``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from specserve.orchestrator.api.admission import AdmissionConfig
from specserve.orchestrator.fleet.stall import DEFAULT_STALL_S
from specserve.orchestrator.store import keys
from specserve.orchestrator.store.store_retry import DEFAULT_WINDOW_S as DEFAULT_REDIS_RETRY_S
from specserve.serving.cli_args import add_health_port_argument
from specserve.serving.internal_token import add_internal_token_argument
from specserve.serving.tls import add_tls_arguments
from specserve.telemetry.config import add_telemetry_arguments

DEFAULT_PORT = 50051


def add_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """The orchestrator's flags, with ``SPECSERVE_*`` defaults from ``env``."""
    env = os.environ if env is None else env

    def e(name: str, default: object = None) -> object:
        return env.get(f"SPECSERVE_{name}", default)

    g = parser.add_argument_group("replicas")
    g.add_argument(
        "--draft",
        default=e("DRAFT_ENDPOINTS", ""),
        help="draft replicas: host:port[,host:port] or dns:///name:port",
    )
    g.add_argument(
        "--target",
        default=e("TARGET_ENDPOINTS"),
        required=not e("TARGET_ENDPOINTS"),
        help="target replicas: host:port[,host:port] or dns:///name:port",
    )
    g.add_argument("--dns-refresh-s", type=float, default=float(str(e("DNS_REFRESH_S", 10.0))))
    g.add_argument(
        "--tokenizer",
        default=e("TOKENIZER"),
        help="model (store name, directory) whose tokenizer serves text prompts",
    )
    g = parser.add_argument_group("session store")
    g.add_argument(
        "--redis-url",
        default=e("REDIS_URL"),
        help="redis:// or rediss:// URL; omit for the embedded store",
    )
    g.add_argument(
        "--redis-password-file",
        default=e("REDIS_PASSWORD_FILE"),
        help="file holding the Redis password (overrides the URL's); or set "
        "SPECSERVE_REDIS_PASSWORD",
    )
    g.add_argument(
        "--redis-password",
        default=None,
        help="discouraged, warns: visible in the process list; use --redis-password-file",
    )
    # Read here, as every environment default, but kept out of --help and argv.
    parser.set_defaults(redis_password_env=e("REDIS_PASSWORD"))
    g.add_argument("--redis-tls-ca", default=e("REDIS_TLS_CA"), help="CA bundle for rediss://")
    g.add_argument("--redis-tls-cert", default=e("REDIS_TLS_CERT"), help="client certificate")
    g.add_argument("--redis-tls-key", default=e("REDIS_TLS_KEY"), help="client key")
    g.add_argument("--redis-tls-no-verify-hostname", action="store_true")
    g.add_argument(
        "--session-ttl-s", type=float, default=float(str(e("SESSION_TTL_S", keys.SESSION_TTL_S)))
    )
    g.add_argument(
        "--session-lease-s",
        type=float,
        default=float(str(e("SESSION_LEASE_S", keys.LEASE_S))),
        help="a generating session's lease, renewed by its orchestrator; after a crash "
        "another orchestrator may take the session over this long after the last renewal",
    )
    g.add_argument(
        "--redis-retry-s",
        type=float,
        default=float(str(e("REDIS_RETRY_S", DEFAULT_REDIS_RETRY_S))),
        help="retry reads and writes on transient Redis errors (a restart) this long before "
        "failing the request",
    )
    g = parser.add_argument_group("admission (see docs/robustness.md)")
    defaults = AdmissionConfig()
    for flag, name, what in (
        ("--max-prompt-tokens", "MAX_PROMPT_TOKENS", "tokens of a session after its prompt"),
        ("--max-prompt-bytes", "MAX_PROMPT_BYTES", "UTF-8 bytes of a text or chat prompt"),
        ("--max-stop-strings", "MAX_STOP_STRINGS", "stop strings of a request"),
        ("--max-stop-bytes", "MAX_STOP_BYTES", "bytes of one stop string"),
        ("--max-stop-total-bytes", "MAX_STOP_TOTAL_BYTES", "bytes of a request's stop strings"),
    ):
        default = getattr(defaults, name.lower())
        g.add_argument(
            flag,
            type=int,
            default=int(str(e(name, default))),
            help=f"refuse a request past this many {what} (default {default})",
        )
    g = parser.add_argument_group("scheduling")
    g.add_argument(
        "--k-max",
        type=int,
        default=int(str(e("K_MAX", 8))),
        help="largest k, and the k cap while the target batch is small",
    )
    full_below, zero_at = e("K_FULL_BELOW"), e("K_ZERO_AT")
    g.add_argument(
        "--k-full-below",
        type=int,
        default=None if full_below is None else int(str(full_below)),
        help="target batch up to which the load curve allows --k-max (default 1 with "
        "--devices shared; separate: no load curve unless this or --k-zero-at is set)",
    )
    g.add_argument(
        "--k-zero-at",
        type=int,
        default=None if zero_at is None else int(str(zero_at)),
        help="target batch from which the load curve allows 0, linear in between (default "
        "2 with --devices shared; separate: no load curve unless set)",
    )
    plain_steps = e("PLAIN_STEPS")
    g.add_argument(
        "--plain-steps",
        type=int,
        default=None if plain_steps is None else int(str(plain_steps)),
        help="tokens a round without drafts decodes in one Verify, 1..64 (multi-step "
        "decoding; default 8 with --devices separate, 1 with shared)",
    )
    g.add_argument(
        "--max-batch",
        type=int,
        default=int(str(e("MAX_BATCH", 64))),
        help="sessions per Verify call",
    )
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=int(str(e("MAX_PREFILL_TOKENS", 512))),
        help="the most rows a round sends its target (verify rows and prefill chunks "
        "together); the budget is measured below it, so a round stays near its usual "
        "length, and a longer prompt is prefilled in chunks over several rounds",
    )
    window = e("ADMISSION_WINDOW_MS")
    g.add_argument(
        "--admission-window-ms",
        type=float,
        default=None if window is None else float(str(window)),
        help="an idle lane waits this long before its first round, so requests that "
        "arrive together are prefilled together (0: start at once; default 10 with "
        "--devices shared, 2 with separate)",
    )
    g.add_argument(
        "--devices",
        choices=["separate", "shared"],
        default=str(e("DEVICES", "separate")),
        help="whether draft and target share hardware (shared: one machine's cores, as "
        "specserve up runs them) or have their own accelerators (separate); the cost "
        "model starts from it",
    )
    g.add_argument(
        "--policy",
        default=str(e("POLICY", "")),
        help="ablation overrides of the scheduling policy: field=value,... "
        "(docs/scheduling.md lists the fields)",
    )
    g.add_argument("--draft-timeout-s", type=float, default=float(str(e("DRAFT_TIMEOUT_S", 2.0))))
    g.add_argument(
        "--target-timeout-s",
        type=float,
        default=float(str(e("TARGET_TIMEOUT_S", 60.0))),
        help="the least a Verify is given before it counts as slow; a larger call gets "
        "its rows times the target's measured seconds per row (times 8), and a slow "
        "target twice that on the replay",
    )
    g.add_argument(
        "--target-stall-s",
        type=float,
        default=float(str(e("TARGET_STALL_S", DEFAULT_STALL_S))),
        help="fail a target over when, this long while it held a round, its model thread "
        "took no step and no CPU time, or it did not answer at all (a hung or stopped "
        "replica), and another target is usable; a slow one, or a lone one, is waited for",
    )
    g.add_argument(
        "--failover-s",
        type=float,
        default=float(str(e("FAILOVER_S", 20.0))),
        help="how long a session waits for a target replica to come back",
    )
    g = parser.add_argument_group("KV snapshots")
    g.add_argument(
        "--kv-snapshots",
        action="store_true",
        default=str(e("KV_SNAPSHOTS", "")).lower() in ("1", "true", "yes", "on"),
        help="save each session's target KV to Redis in chunks and restore it on a target "
        "failover instead of re-prefilling",
    )
    g.add_argument(
        "--kv-snapshot-chunk-tokens",
        type=int,
        default=int(str(e("KV_SNAPSHOT_CHUNK_TOKENS", 64))),
        help="positions per snapshot chunk (only whole chunks are saved)",
    )
    g.add_argument(
        "--kv-snapshot-every",
        type=int,
        default=int(str(e("KV_SNAPSHOT_EVERY", 1))),
        help="export once a session's target holds this many new whole chunks",
    )
    g.add_argument(
        "--kv-snapshot-ttl-s",
        type=float,
        default=float(str(e("KV_SNAPSHOT_TTL_S", keys.KV_TTL_S))),
        help="a chunk expires this long after it was last written or read",
    )
    g.add_argument(
        "--kv-snapshot-redis-url",
        default=e("KV_SNAPSHOT_REDIS_URL"),
        help="a separate Redis for the chunks (they are large); default: the session store",
    )
    g = parser.add_argument_group("serving")
    g.add_argument(
        "--host",
        default=e("HOST", "127.0.0.1"),
        help="address to bind (default loopback only; 0.0.0.0 in a container, with TLS "
        "and --api-keys-file)",
    )
    g.add_argument("--port", type=int, default=int(str(e("PORT", DEFAULT_PORT))))
    g.add_argument(
        "--port-file", default=e("PORT_FILE"), help="write the bound port here once listening"
    )
    g.add_argument("--grace-s", type=float, default=float(str(e("GRACE_S", 10.0))))
    g.add_argument("--replica-id", default=e("REPLICA_ID", ""))
    g.add_argument(
        "--served-model-name",
        default=e("SERVED_MODEL_NAME"),
        help="the model name traces report (gen_ai.request.model); default the tokenizer's",
    )
    add_tls_arguments(parser, env, role="orchestrator")
    add_health_port_argument(parser, env)
    parser.add_argument_group("authentication").add_argument(
        "--api-keys-file",
        default=e("API_KEYS_FILE"),
        metavar="FILE",
        help="bearer keys the public API accepts, one per line (docs/security.md); "
        "default: no key needed",
    )
    add_internal_token_argument(parser, env)
    add_telemetry_arguments(parser, env)
