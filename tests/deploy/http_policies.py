"""Checks of the OpenAI door's manifests (``specserve http-server``), as functions that
list what a set of rendered documents breaks (empty: they pass).

The http-server is not a gRPC server: it serves HTTP on one port (the API, ``/health``
and ``/metrics``) and is a *client* of the orchestrators' gRPC API. So its checks are
its own: the address it dials is the orchestrators' Service on their gRPC port; its
probes are HTTP GETs of paths it serves on that port, readiness on ``/health`` (which
follows the orchestrators) and liveness elsewhere (an orchestrator outage must not
restart every http-server); the NetworkPolicies let it reach the orchestrators and
let the monitoring namespace reach its ``/metrics``. Flags are read by the real
``specserve`` parser, as for the other containers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tests.deploy.manifests import Doc, by_kind, cli_args, container_env, specserve_argv

HTTP_SERVER = "http-server"  # the subcommand
ORCHESTRATOR = "orchestrator"
NAME = "app.kubernetes.io/name"
NAMESPACE_LABEL = "kubernetes.io/metadata.name"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
READINESS_PATH = "/health"
# Upstream.serving's deadline for the orchestrator's health check: /health can take this
# long to answer 503, so a readiness probe must wait longer.
HEALTH_CHECK_S = 2


@dataclass(frozen=True)
class Process:
    """One container running a ``specserve`` server, as its Deployment runs it."""

    deployment: str
    template: Doc  # the pod template (metadata and spec)
    container: Doc
    args: Any  # the real parser's argparse.Namespace

    @property
    def pod(self) -> Doc:
        spec: Doc = self.template["spec"]
        return spec

    @property
    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.template["metadata"].get("labels", {})
        return labels


def processes(docs: list[Doc], command: str) -> list[Process]:
    """Every Deployment container that runs ``specserve <command>``, with its parsed flags."""
    found = []
    for name, dep in by_kind(docs, "Deployment").items():
        template = dep["spec"]["template"]
        for c in template["spec"]["containers"]:
            argv = specserve_argv(c)
            if argv is not None and argv[0] == command:
                found.append(Process(name, template, c, cli_args(argv, container_env(c))))
    return found


def container_port(c: Doc, port: str | int) -> int | None:
    """The container port a probe or Service names (by name or number), or None."""
    for p in c.get("ports", []):
        if port in (p.get("name"), p["containerPort"]):
            number: int = p["containerPort"]
            return number
    return None


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` of a gRPC target (``dns:///`` stripped) as (host, port)."""
    host, _, port = address.removeprefix("dns:///").rpartition(":")
    return host, int(port)


def orchestrator_address_gaps(docs: list[Doc]) -> list[str]:
    """http-servers whose ``--orchestrator`` is not the orchestrators' gRPC port.

    The host must be a Service of the documents (same namespace: the bare name) that
    selects the orchestrator pods, and the port a port of that Service whose
    targetPort is the container port the orchestrator's ``--port`` binds.
    """
    services = by_kind(docs, "Service")
    orchestrators = processes(docs, ORCHESTRATOR)
    problems = []
    for http in processes(docs, HTTP_SERVER):
        where = f"{http.deployment}: --orchestrator {http.args.orchestrator}"
        try:
            host, port = split_address(http.args.orchestrator)
        except ValueError:
            problems.append(f"{where} is not host:port")
            continue
        svc = services.get(host)
        if svc is None:
            problems.append(f"{where}: no Service {host}")
            continue
        selector = svc["spec"].get("selector", {})
        behind = [o for o in orchestrators if selector and selector.items() <= o.labels.items()]
        if not behind:
            problems.append(f"{where}: Service {host} selects no orchestrator")
            continue
        svc_port = next((p for p in svc["spec"]["ports"] if p["port"] == port), None)
        if svc_port is None:
            problems.append(f"{where}: Service {host} has no port {port}")
            continue
        for o in behind:
            target = container_port(o.container, svc_port.get("targetPort", port))
            if target != o.args.port:
                problems.append(
                    f"{where}: Service port {port} reaches {target}, "
                    f"not {o.deployment}'s --port {o.args.port}"
                )
    return problems


def probe_gaps(docs: list[Doc], served_paths: Iterable[str]) -> list[str]:
    """http-server probes that would not ask the server what they mean to.

    Every probe is an HTTP GET on the container port the server binds (``--port``) of
    a path in ``served_paths`` (the app's GET routes). Readiness asks ``/health``
    (200 only while the orchestrator answers SERVING) with a timeout above its
    upstream check's; startup and liveness ask another path, which makes no gRPC call.
    """
    paths = set(served_paths)
    problems = []
    for http in processes(docs, HTTP_SERVER):
        c, name = http.container, http.deployment
        for probe in PROBES:
            if probe not in c:
                problems.append(f"{name}: no {probe}")
                continue
            get = c[probe].get("httpGet")
            if get is None:
                problems.append(f"{name} {probe}: not an HTTP GET")
                continue
            port = container_port(c, get.get("port"))
            if port != http.args.port:
                problems.append(f"{name} {probe}: port {get.get('port')}, not --port")
            path = get.get("path", "/")
            if path not in paths:
                problems.append(f"{name} {probe}: GET {path} is not served")
            if (probe == "readinessProbe") != (path == READINESS_PATH):
                problems.append(
                    f"{name} {probe}: GET {path}; readiness asks {READINESS_PATH}, "
                    "liveness and startup must not depend on the orchestrator"
                )
        timeout = c.get("readinessProbe", {}).get("timeoutSeconds", 1)
        if timeout <= HEALTH_CHECK_S:
            problems.append(
                f"{name} readinessProbe: timeoutSeconds {timeout} <= the {HEALTH_CHECK_S} s "
                "health check behind /health"
            )
    return problems


# -- NetworkPolicies ---------------------------------------------------------------------


def _matches(selector: Doc | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels only, as these manifests use) against labels."""
    if selector is None:
        return False
    assert not selector.get("matchExpressions"), "matchExpressions: not modelled here"
    match: dict[str, str] = selector.get("matchLabels", {})
    return match.items() <= labels.items()


def _peer_admits(peer: Doc, pod: dict[str, str], ns: dict[str, str], same_ns: bool) -> bool:
    if "ipBlock" in peer:
        return False  # pod traffic inside the cluster is not matched by ipBlocks here
    # A namespaceSelector picks namespaces; without one the peer is in the policy's own.
    ns_ok = _matches(peer["namespaceSelector"], ns) if "namespaceSelector" in peer else same_ns
    pod_ok = _matches(peer["podSelector"], pod) if "podSelector" in peer else True
    return ns_ok and pod_ok


def admits(
    docs: list[Doc],
    source_pod: dict[str, str],
    source_namespace: str,
    target: Process,
    port: str | int,
) -> bool:
    """Whether the documents' NetworkPolicies let a pod labelled ``source_pod`` in
    ``source_namespace`` open a TCP connection to ``port`` (name or number) of the
    ``target`` process's pods (in the namespace ``specserve``). Kubernetes' rule: with
    no Ingress policy selecting the target everything passes; otherwise some rule of a
    selecting policy must match both the peer and the port."""
    target_pod = target.labels
    number = container_port(target.container, port)
    names = {
        p.get("name") for p in target.container.get("ports", []) if p["containerPort"] == number
    }
    wanted = {port, number} | names
    ns_labels = {NAMESPACE_LABEL: source_namespace}
    same_ns = source_namespace == "specserve"
    selecting = [
        p
        for p in by_kind(docs, "NetworkPolicy").values()
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and _matches(p["spec"]["podSelector"], target_pod)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from", [])
            if peers and not any(_peer_admits(p, source_pod, ns_labels, same_ns) for p in peers):
                continue
            ports = rule.get("ports", [])
            if not ports or any(p.get("port") in wanted for p in ports):
                return True
    return False


def network_gaps(docs: list[Doc], monitoring_ns: str = "monitoring") -> list[str]:
    """Connections the OpenAI door needs that the NetworkPolicies refuse: every
    http-server pod to every orchestrator's gRPC port, and the monitoring namespace to
    the http-server's HTTP port (its ``/metrics``)."""
    problems = []
    orchestrators = processes(docs, ORCHESTRATOR)
    for http in processes(docs, HTTP_SERVER):
        for o in orchestrators:
            if not admits(docs, http.labels, "specserve", o, o.args.port):
                problems.append(f"{http.deployment} cannot reach {o.deployment}:{o.args.port}")
        scraper = {NAME: "prometheus"}
        if not admits(docs, scraper, monitoring_ns, http, http.args.port):
            problems.append(f"{monitoring_ns} cannot scrape {http.deployment}:{http.args.port}")
    return problems
