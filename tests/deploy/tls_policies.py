"""Checks of the TLS and API-key components (``k8s/components/{tls,api-keys,cert-manager}``),
as functions that list what a set of rendered documents breaks (empty: they pass): the
gRPC servers' TLS, and the http-server's TLS channel to the orchestrators.

The flags are read by the real ``specserve`` parser from each container's command and
environment, so a check sees what the process would run with, whichever form the
manifest uses. File paths are checked against the Secret volumes the container mounts.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from tests.deploy.manifests import Doc, by_kind, cli_args, container_env, specserve_argv
from tests.deploy.secret_mounts import secret_files, secret_volumes

GRPC_SERVERS = ("draft-server", "target-server", "orchestrator")
ORCHESTRATOR = "specserve-orchestrator"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
CLIENT_AUTH = "client auth"


def _servers(
    docs: list[Doc], commands: Collection[str] = GRPC_SERVERS
) -> list[tuple[str, Doc, Doc, Any]]:
    """(Deployment, pod spec, container, parsed flags) of every container running one of
    ``commands`` (by default every gRPC server)."""
    found = []
    for name, dep in by_kind(docs, "Deployment").items():
        pod = dep["spec"]["template"]["spec"]
        for c in pod["containers"]:
            argv = specserve_argv(c)
            if argv is not None and argv[0] in commands:
                found.append((name, pod, c, cli_args(argv, container_env(c))))
    return found


def tls_gaps(docs: list[Doc]) -> list[str]:
    """gRPC servers without TLS material from a read-only Secret, or with probes that
    would try plaintext on the TLS port.

    Every server: ``--tls-cert``, ``--tls-key`` and ``--tls-ca`` set, each a file of a
    Secret volume mounted read-only; ``--health-port`` set, a container port, and every
    probe a gRPC probe on it (the kubelet cannot speak TLS).
    """
    problems = []
    for name, pod, c, args in _servers(docs):
        files = secret_files(pod, c)
        for flag in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(args, flag)
            option = "--" + flag.replace("_", "-")
            if not path:
                problems.append(f"{name}: no {option}")
            elif path not in files:
                problems.append(f"{name}: {option} {path} is not a file of a mounted Secret")
            elif not files[path].read_only:
                problems.append(f"{name}: {option} {path} is mounted writable")
        health = args.health_port
        if health is None:
            problems.append(f"{name}: TLS without --health-port: the probes cannot connect")
            continue
        if health == args.port:
            problems.append(f"{name}: --health-port is the TLS port")
        if health not in {p["containerPort"] for p in c.get("ports", [])}:
            problems.append(f"{name}: --health-port {health} is not a container port")
        probes = [p for p in PROBES if p in c]
        if not probes:
            problems.append(f"{name}: no probes")
        for probe in probes:
            port = c[probe].get("grpc", {}).get("port")
            if port != health:
                problems.append(f"{name} {probe}: port {port}, not the health port {health}")
    return problems


def http_server_tls_gaps(docs: list[Doc]) -> list[str]:
    """http-servers whose channel to the orchestrators does not match what they serve.

    Orchestrators with ``--tls-cert`` serve TLS only: every http-server needs
    ``--tls-ca`` (which turns its TLS on) as a file of a Secret mounted read-only, and
    so do ``--tls-cert``/``--tls-key`` where given. Plaintext orchestrators: an
    http-server with ``--tls-ca`` would fail every handshake.
    """
    orchestrators_tls = [bool(s[3].tls_cert) for s in _servers(docs) if s[0] == ORCHESTRATOR]
    problems = []
    for name, pod, c, args in _servers(docs, {"http-server"}):
        if any(orchestrators_tls) and not args.tls_ca:
            problems.append(f"{name}: the orchestrators serve TLS; no --tls-ca")
        if not all(orchestrators_tls) and args.tls_ca:
            problems.append(f"{name}: --tls-ca, but an orchestrator serves plaintext")
        files = secret_files(pod, c)
        for flag in ("tls_ca", "tls_cert", "tls_key"):
            path = getattr(args, flag)
            option = "--" + flag.replace("_", "-")
            if path and path not in files:
                problems.append(f"{name}: {option} {path} is not a file of a mounted Secret")
            elif path and not files[path].read_only:
                problems.append(f"{name}: {option} {path} is mounted writable")
    return problems


def api_key_gaps(docs: list[Doc]) -> list[str]:
    """Orchestrators without ``--api-keys-file``, or with one that is not a file of a
    Secret mounted read-only."""
    problems = []
    orchestrators = [s for s in _servers(docs) if s[3].command == "orchestrator"]
    if not orchestrators:
        problems.append("no orchestrator")
    for name, pod, c, args in orchestrators:
        path = args.api_keys_file
        files = secret_files(pod, c)
        if not path:
            problems.append(f"{name}: no --api-keys-file")
        elif path not in files:
            problems.append(f"{name}: --api-keys-file {path} is not a file of a mounted Secret")
        elif not files[path].read_only:
            problems.append(f"{name}: --api-keys-file {path} is mounted writable")
    return problems


def replica_auth_gaps(docs: list[Doc]) -> list[str]:
    """gRPC servers that would take calls from anyone (a replica) or could not prove who
    they are to the replicas (an orchestrator): neither mutual TLS (--tls-ca with a
    certificate) nor an --internal-token-file from a Secret mounted read-only."""
    problems = []
    for name, pod, c, args in _servers(docs):
        if args.tls_ca and args.tls_cert:
            continue
        path = args.internal_token_file
        files = secret_files(pod, c)
        if not path:
            problems.append(f"{name}: neither mutual TLS nor --internal-token-file")
        elif path not in files or not files[path].read_only:
            problems.append(f"{name}: --internal-token-file {path} is not a read-only Secret")
    return problems


def writable_secrets(docs: list[Doc]) -> list[str]:
    """Secret volumes mounted writable or with files others than owner and group can
    read (every mount of every container, init containers included)."""
    problems = []
    for kind in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
        for name, workload in by_kind(docs, kind).items():
            pod = workload["spec"]["template"]["spec"]
            secrets = secret_volumes(pod)
            for vol, source in secrets.items():
                modes = [source.get("defaultMode", 0o644)]
                modes += [i["mode"] for i in source.get("items", []) if "mode" in i]
                if any(m & 0o007 for m in modes):
                    problems.append(f"{kind}/{name}: Secret volume {vol} is world-readable")
            for c in [*pod.get("initContainers", []), *pod["containers"]]:
                for m in c.get("volumeMounts", []):
                    if m["name"] in secrets and not m.get("readOnly"):
                        problems.append(f"{kind}/{name} {c['name']}: {m['name']} is writable")
    return problems


def health_port_admitted(docs: list[Doc]) -> list[str]:
    """NetworkPolicy rules that let pods reach a health port. The kubelet's probes come
    from the pod's node, which NetworkPolicies always admit, so no rule needs it."""
    problems = []
    for name, dep in by_kind(docs, "Deployment").items():
        template = dep["spec"]["template"]
        labels = template["metadata"].get("labels", {})
        health = {
            key
            for c in template["spec"]["containers"]
            for p in c.get("ports", [])
            if p.get("name") == "health"
            for key in (p["name"], p["containerPort"])
        }
        if not health:
            continue
        for policy in by_kind(docs, "NetworkPolicy").values():
            selector = policy["spec"]["podSelector"].get("matchLabels", {})
            if not selector.items() <= labels.items():
                continue
            for rule in policy["spec"].get("ingress", []):
                ports = {p.get("port") for p in rule.get("ports", [])}
                if not rule.get("ports") or ports & health:
                    problems.append(
                        f"Deployment {name}: NetworkPolicy {policy['metadata']['name']} "
                        f"admits the health port ({rule.get('ports', 'every port')})"
                    )
    return problems


def certificate_gaps(docs: list[Doc]) -> list[str]:
    """cert-manager Certificates that do not fit the TLS component: a pool's Secret that
    no Certificate writes (the http-servers': the one behind their ``--tls-ca``), a
    replica certificate without the Service name the orchestrators check it against, an
    orchestrator certificate without the name the http-servers check it against (the
    host they dial, or their ``--tls-server-name``) or without clientAuth (it is
    presented to the replicas), an issuer that is not in the documents."""
    certs = {c["spec"]["secretName"]: c for c in by_kind(docs, "Certificate").values()}
    issuers = set(by_kind(docs, "Issuer"))
    problems = [
        f"Certificate {c['metadata']['name']}: issuer {c['spec']['issuerRef']['name']} missing"
        for c in certs.values()
        if c["spec"]["issuerRef"]["name"] not in issuers
    ]
    dialled: dict[str, str] = {}  # Deployment -> the host name the orchestrators dial
    for *_, args in _servers(docs):
        if args.command == "orchestrator":
            for endpoints, pool in (
                (args.target, "specserve-target"),
                (args.draft, "specserve-draft"),
            ):
                host = (endpoints or "").removeprefix("dns:///").partition(":")[0]
                dialled[pool] = host
    for name, pod, c, args in _servers(docs, {"http-server"}):
        if not args.tls_ca:
            continue
        host = args.orchestrator.removeprefix("dns:///").rpartition(":")[0]
        dialled[ORCHESTRATOR] = args.tls_server_name or host
        ca = secret_files(pod, c).get(args.tls_ca)
        if ca is None or ca.secret not in certs:
            problems.append(f"{name}: no Certificate writes its TLS Secret")
    for name, pod, c, args in _servers(docs):
        secret = secret_files(pod, c).get(args.tls_cert or "")
        cert = certs.get(secret.secret) if secret else None
        if cert is None:
            problems.append(f"{name}: no Certificate writes its TLS Secret")
            continue
        spec = cert["spec"]
        if name in dialled and dialled[name] not in spec.get("dnsNames", []):
            problems.append(f"Certificate for {name} lacks the name dialled: {dialled[name]}")
        if args.command == "orchestrator" and CLIENT_AUTH not in spec.get("usages", []):
            problems.append(f"Certificate for {name}: no {CLIENT_AUTH} for the replicas")
    return problems
