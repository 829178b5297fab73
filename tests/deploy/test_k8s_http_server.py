"""The OpenAI door (``specserve http-server``) in every overlay and composition.

Each rendered overlay, alone and with the gateway, TLS, API-key and cert-manager
components, deploys the http-server beside the orchestrators: a Deployment with its
Service, HPA, PodDisruptionBudget and NetworkPolicy; its ``--orchestrator`` is the
orchestrators' Service on the port they bind; its probes GET paths the real app
serves on its port, readiness ``/health`` (which follows the orchestrator, shown
here against a gRPC health server switched from SERVING to NOT_SERVING) and liveness
a path that does not; the NetworkPolicies admit it to the orchestrators (the gateway
component narrows their open rule) and monitoring to its ``/metrics``; with TLS to the
orchestrators its CA is a file of a Secret it mounts read-only, which cert-manager
writes, and the orchestrators' certificate names the host it dials. Every check is
then fed a manifest that breaks it and must complain.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from pathlib import Path

import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.routing import Route

from specserve.engine.errors import InvalidArgument
from specserve.openai_api import config as http_config
from specserve.openai_api.app import build_app
from specserve.openai_api.config import HttpServerConfig
from tests.deploy import http_policies, policies, tls_policies
from tests.deploy.http_policies import HTTP_SERVER, processes
from tests.deploy.manifests import (
    K8S,
    Doc,
    by_kind,
    cli_args,
    container_env,
    needs_kubectl,
    render,
    render_overlay,
    throwaway_overlay,
)
from tests.deploy.secret_mounts import StandIns
from tests.deploy.test_k8s_manifests import check_docs

pytestmark = needs_kubectl

DOOR = "specserve-http-server"
# Every overlay, and the components composed as an operator would.
COMPOSED = {
    "cpu": ("cpu", []),
    "gpu": ("gpu", []),  # tls and api-keys on
    "cpu+gateway": ("cpu", ["gateway"]),
    "gpu+gateway": ("gpu", ["gateway"]),
    "cpu+cert-manager+tls+api-keys+gateway": (
        "cpu",
        ["cert-manager", "tls", "api-keys", "gateway"],
    ),
}
WITH_TLS = ("gpu", "gpu+gateway", "cpu+cert-manager+tls+api-keys+gateway")
WITH_GATEWAY = ("cpu+gateway", "gpu+gateway", "cpu+cert-manager+tls+api-keys+gateway")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Doc]]:
    out = {}
    for name, (overlay, components) in COMPOSED.items():
        if not components:
            out[name] = render_overlay(overlay)
        else:
            out[name] = render(
                throwaway_overlay(tmp_path_factory.mktemp(name), overlay, components)
            )
    return out


def served_get_paths() -> set[str]:
    """The paths the real app answers GET on (without path parameters)."""
    app = build_app(HttpServerConfig(orchestrator="127.0.0.1:1"))
    return {
        r.path
        for r in app.routes
        if isinstance(r, Route) and "GET" in (r.methods or set()) and "{" not in r.path
    }


def door(docs: list[Doc]) -> Doc:
    """The http-server's container in the documents."""
    dep = by_kind(docs, "Deployment")[DOOR]
    c: Doc = dep["spec"]["template"]["spec"]["containers"][0]
    return c


def set_env(c: Doc, name: str, value: str | None) -> None:
    """Set (or, with None, remove) a container's environment variable."""
    c["env"] = [e for e in c["env"] if e["name"] != name]
    if value is not None:
        c["env"].append({"name": name, "value": value})


# -- what every overlay deploys ------------------------------------------------------------


def test_every_overlay_deploys_the_door_beside_the_orchestrators(
    rendered: dict[str, list[Doc]],
) -> None:
    for name, docs in rendered.items():
        (http,) = processes(docs, HTTP_SERVER)
        assert http.deployment == DOOR, name
        assert "replicas" not in by_kind(docs, "Deployment")[DOOR]["spec"], "the HPA owns it"
        svc = by_kind(docs, "Service")[DOOR]
        assert svc["spec"].get("clusterIP") != "None", f"{name}: a balanced Service"
        assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"], name
        hpa = by_kind(docs, "HorizontalPodAutoscaler")[DOOR]
        assert hpa["spec"]["scaleTargetRef"]["name"] == DOOR and hpa["spec"]["minReplicas"] >= 2
        pdb = by_kind(docs, "PodDisruptionBudget")[DOOR]
        assert policies.selects(pdb["spec"]["selector"]["matchLabels"], http.labels), name
        assert http_policies.orchestrator_address_gaps(docs) == [], name
        assert http_policies.probe_gaps(docs, served_get_paths()) == [], name
        assert http_policies.network_gaps(docs) == [], name
        assert policies.network_gaps(docs) == [], name
        assert policies.restricted_violations(docs) == [], name
        assert policies.unwritable_caches(docs) == [], name
        assert tls_policies.http_server_tls_gaps(docs) == [], name


def test_every_composition_matches_the_code(
    rendered: dict[str, list[Doc]], monkeypatch: pytest.MonkeyPatch, stand_ins: StandIns
) -> None:
    """The real CLI builds the door's config from each rendered container."""
    for docs in rendered.values():
        check_docs(docs, monkeypatch, stand_ins)


def test_the_gateway_routes_the_openai_api(rendered: dict[str, list[Doc]]) -> None:
    """Only /v1 goes through the gateway, to the door's Service port; /health and
    /metrics stay inside the cluster."""
    for name in WITH_GATEWAY:
        docs = rendered[name]
        (route,) = by_kind(docs, "HTTPRoute").values()
        (rule,) = route["spec"]["rules"]
        assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}], name
        (backend,) = rule["backendRefs"]
        svc = by_kind(docs, "Service")[backend["name"]]
        assert backend["port"] in {p["port"] for p in svc["spec"]["ports"]}
        assert svc["spec"]["selector"] == {"app.kubernetes.io/name": DOOR}
        (grpc_route,) = by_kind(docs, "GRPCRoute").values()
        assert route["spec"]["parentRefs"] == grpc_route["spec"]["parentRefs"]
    for name in set(rendered) - set(WITH_GATEWAY):
        assert not by_kind(rendered[name], "HTTPRoute"), name


def test_the_gateway_narrows_the_door_and_keeps_its_way_in(
    rendered: dict[str, list[Doc]],
) -> None:
    """With the gateway, the door takes HTTP from the gateway's namespace and not from a
    pod elsewhere; the orchestrators still take the door's calls."""
    for name in WITH_GATEWAY:
        docs = rendered[name]
        (http,) = processes(docs, HTTP_SERVER)
        (orch,) = processes(docs, "orchestrator")
        gateway_pod, stranger = {"app": "envoy"}, {"app": "anything"}
        assert http_policies.admits(docs, gateway_pod, "gateway-system", http, "http"), name
        assert not http_policies.admits(docs, stranger, "default", http, "http"), name
        assert not http_policies.admits(docs, stranger, "default", orch, "grpc"), name
        assert http_policies.admits(docs, http.labels, "specserve", orch, "grpc"), name
    # Without it, the door is open to anyone on its HTTP port, and on no other.
    docs = rendered["cpu"]
    (http,) = processes(docs, HTTP_SERVER)
    assert http_policies.admits(docs, {"app": "anything"}, "default", http, 8000)
    assert not http_policies.admits(docs, {"app": "anything"}, "default", http, 9999)


# -- probes against the real app -----------------------------------------------------------


async def get_status(app: Starlette, path: str) -> int:
    """The HTTP status the ASGI app answers to ``GET path``."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"specserve-http-server")],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }
    status = 0

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, object]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])  # type: ignore[call-overload]

    await app(scope, receive, send)
    return status


async def probe_statuses(config: HttpServerConfig, probes: dict[str, str]) -> list[dict[str, int]]:
    """Each probe's status from the app built from ``config``, dialling a gRPC health
    server that answers SERVING, then NOT_SERVING (the orchestrator drained or down)."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        app = build_app(dataclasses.replace(config, orchestrator=f"127.0.0.1:{port}"))
        out = []
        async with app.state.api.lifespan(app):
            for state in (
                health_pb2.HealthCheckResponse.SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING,
            ):
                await servicer.set("", state)
                out.append({p: await get_status(app, path) for p, path in probes.items()})
        return out
    finally:
        await server.stop(None)


def test_readiness_follows_the_orchestrator_and_liveness_does_not(
    rendered: dict[str, list[Doc]],
) -> None:
    """The probes of the rendered container, asked of the app its flags build."""
    c = door(rendered["cpu"])
    args = cli_args(["http-server", *c["args"]], container_env(c))
    config = http_config.from_args(args)
    probes = {p: c[p]["httpGet"]["path"] for p in http_policies.PROBES}
    serving, not_serving = asyncio.run(probe_statuses(config, probes))
    assert serving == dict.fromkeys(probes, 200)
    assert not_serving == {"startupProbe": 200, "readinessProbe": 503, "livenessProbe": 200}


# -- TLS and keys ---------------------------------------------------------------------------


def test_with_tls_the_door_dials_with_a_mounted_ca(rendered: dict[str, list[Doc]]) -> None:
    for name in WITH_TLS:
        docs = rendered[name]
        (http,) = processes(docs, HTTP_SERVER)
        assert http.args.tls_ca == "/etc/specserve/tls/ca.crt", name
        volume = next(v for v in http.pod["volumes"] if v["name"] == "tls")
        assert volume["secret"]["secretName"] == "specserve-http-server-tls"
        assert tls_policies.http_server_tls_gaps(docs) == [], name
        assert tls_policies.writable_secrets(docs) == [], name
        # The orchestrators' public port asks no client certificate: the door keeps
        # none, and checks a name the orchestrators' certificate carries (below).
        assert http.args.tls_cert is None and http.args.tls_server_name is None
    (http,) = processes(rendered["cpu"], HTTP_SERVER)
    assert http.args.tls_ca is None  # plaintext orchestrators, plaintext channel


def test_cert_manager_writes_the_door_ca_and_names_the_host_it_dials(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = rendered["cpu+cert-manager+tls+api-keys+gateway"]
    assert tls_policies.certificate_gaps(docs) == []
    certs = by_kind(docs, "Certificate")
    assert certs[DOOR]["spec"]["secretName"] == "specserve-http-server-tls"
    assert "specserve" in certs["specserve-orchestrator"]["spec"]["dnsNames"]


def test_api_keys_stay_with_the_orchestrators(rendered: dict[str, list[Doc]]) -> None:
    """The door forwards each caller's Authorization header and checks no key itself
    (docs/openai-api.md): with the api-keys component only the orchestrators mount the
    keys, and the door's Deployment is not touched by it."""
    for name in ("gpu", "cpu+cert-manager+tls+api-keys+gateway"):
        docs = rendered[name]
        assert tls_policies.api_key_gaps(docs) == [], name
        pod = by_kind(docs, "Deployment")[DOOR]["spec"]["template"]["spec"]
        secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert secrets == {"specserve-http-server-tls"}, name


# -- each check complains about a manifest that breaks it -----------------------------------


def test_a_wrong_orchestrator_address_would_be_caught(rendered: dict[str, list[Doc]]) -> None:
    docs = copy.deepcopy(rendered["cpu"])
    c = door(docs)
    for address, why in [
        ("specserve-orchestrator:50051", "no Service specserve-orchestrator"),
        ("specserve:50052", "Service specserve has no port 50052"),
        ("specserve-target:50061", "Service specserve-target selects no orchestrator"),
    ]:
        set_env(c, "SPECSERVE_ORCHESTRATOR", address)
        (gap,) = http_policies.orchestrator_address_gaps(docs)
        assert gap.endswith(why), gap
    set_env(c, "SPECSERVE_ORCHESTRATOR", "specserve:50051")
    by_kind(docs, "Service")["specserve"]["spec"]["ports"][0]["targetPort"] = 9464
    (gap,) = http_policies.orchestrator_address_gaps(docs)
    assert "reaches 9464, not specserve-orchestrator's --port 50051" in gap


def test_probes_that_ask_the_wrong_thing_would_be_caught(rendered: dict[str, list[Doc]]) -> None:
    docs = copy.deepcopy(rendered["cpu"])
    c = door(docs)
    c["livenessProbe"]["httpGet"]["path"] = "/health"  # restarts on an orchestrator outage
    c["readinessProbe"]["httpGet"]["path"] = "/healthz"
    c["readinessProbe"]["timeoutSeconds"] = 1
    c["startupProbe"]["httpGet"]["port"] = 9464
    gaps = http_policies.probe_gaps(docs, served_get_paths())
    assert any(g.startswith(f"{DOOR} livenessProbe: GET /health; readiness") for g in gaps)
    assert f"{DOOR} readinessProbe: GET /healthz is not served" in gaps
    assert any(g.startswith(f"{DOOR} readinessProbe: timeoutSeconds 1") for g in gaps)
    assert f"{DOOR} startupProbe: port 9464, not --port" in gaps
    assert len(gaps) == 5, gaps  # /healthz is also not /health
    del c["startupProbe"]
    c["livenessProbe"] = {"tcpSocket": {"port": "http"}}
    gaps = http_policies.probe_gaps(docs, served_get_paths())
    assert f"{DOOR}: no startupProbe" in gaps and f"{DOOR} livenessProbe: not an HTTP GET" in gaps


def test_policies_that_shut_the_door_out_would_be_caught(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = copy.deepcopy(rendered["cpu+gateway"])
    netpols = by_kind(docs, "NetworkPolicy")
    orch_rules = netpols["specserve-orchestrator"]["spec"]["ingress"]
    # The rule the gateway's narrowing would leave the door without.
    orch_rules[:] = [r for r in orch_rules if "podSelector" not in r.get("from", [{}])[0]]
    netpols[DOOR]["spec"]["ingress"].pop()  # the monitoring rule
    assert http_policies.network_gaps(docs) == [
        f"{DOOR} cannot reach specserve-orchestrator:50051",
        f"monitoring cannot scrape {DOOR}:8000",
    ]
    # In the base, the orchestrators' open gRPC rule still admits the door.
    docs = copy.deepcopy(rendered["cpu"])
    netpols = by_kind(docs, "NetworkPolicy")
    orch_rules = netpols["specserve-orchestrator"]["spec"]["ingress"]
    orch_rules[:] = [r for r in orch_rules if "podSelector" not in r.get("from", [{}])[0]]
    assert http_policies.network_gaps(docs) == []
    # A door open to anyone on every port is reported.
    netpols[DOOR]["spec"]["ingress"][0].pop("ports")
    assert policies.network_gaps(docs) == [f"Deployment/{DOOR}: {DOOR} admits anyone to every port"]


def test_tls_that_does_not_match_the_orchestrators_would_be_caught(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = copy.deepcopy(rendered["gpu"])
    set_env(door(docs), "SPECSERVE_TLS_CA", None)
    assert tls_policies.http_server_tls_gaps(docs) == [
        f"{DOOR}: the orchestrators serve TLS; no --tls-ca"
    ]
    set_env(door(docs), "SPECSERVE_TLS_CA", "/tmp/ca.crt")  # on the emptyDir
    assert tls_policies.http_server_tls_gaps(docs) == [
        f"{DOOR}: --tls-ca /tmp/ca.crt is not a file of a mounted Secret"
    ]
    docs = copy.deepcopy(rendered["cpu"])
    set_env(door(docs), "SPECSERVE_TLS_CA", "/etc/specserve/tls/ca.crt")
    gaps = tls_policies.http_server_tls_gaps(docs)
    assert f"{DOOR}: --tls-ca, but an orchestrator serves plaintext" in gaps


def test_certificates_that_do_not_fit_the_door_would_be_caught(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = copy.deepcopy(rendered["cpu+cert-manager+tls+api-keys+gateway"])
    by_kind(docs, "Certificate")["specserve-orchestrator"]["spec"]["dnsNames"].remove("specserve")
    docs = [d for d in docs if not (d["kind"] == "Certificate" and d["metadata"]["name"] == DOOR)]
    assert sorted(tls_policies.certificate_gaps(docs)) == [
        "Certificate for specserve-orchestrator lacks the name dialled: specserve",
        f"{DOOR}: no Certificate writes its TLS Secret",
    ]


def test_a_door_that_disagrees_with_the_code_fails_the_cli_check(
    rendered: dict[str, list[Doc]], monkeypatch: pytest.MonkeyPatch, stand_ins: StandIns
) -> None:
    """The check_docs rules the door now passes still bite: a metrics-port variable (the
    server refuses it), another model id than the orchestrators', a metrics Service
    that cannot reach its /metrics, a container port that is not --port."""
    docs = copy.deepcopy(rendered["cpu"])
    set_env(door(docs), "SPECSERVE_METRICS_PORT", "9464")
    with pytest.raises(InvalidArgument, match="--metrics-port"):
        check_docs(docs, monkeypatch, stand_ins)
    docs = copy.deepcopy(rendered["cpu"])
    set_env(door(docs), "SPECSERVE_SERVED_MODEL_NAME", "gpt-4o")
    with pytest.raises(AssertionError, match=f"{DOOR}: model id gpt-4o"):
        check_docs(docs, monkeypatch, stand_ins)
    docs = copy.deepcopy(rendered["cpu"])
    metrics = by_kind(docs, "Service")["specserve-metrics"]["spec"]["ports"]
    metrics[:] = [p for p in metrics if p["targetPort"] != "http"]
    with pytest.raises(AssertionError, match=f"specserve-metrics -> {DOOR}"):
        check_docs(docs, monkeypatch, stand_ins)
    docs = copy.deepcopy(rendered["cpu"])
    door(docs)["ports"][0]["containerPort"] = 8080
    with pytest.raises(AssertionError, match="http = --port"):
        check_docs(docs, monkeypatch, stand_ins)


def test_the_docs_describe_the_door() -> None:
    root = Path(__file__).resolve().parents[2]
    k8s_doc = (root / "docs" / "kubernetes.md").read_text()
    assert "specserve-http-server" in k8s_doc and "k8s/base/http-server.yaml" in k8s_doc
    assert "kubernetes.md#" in (root / "docs" / "openai-api.md").read_text()
    assert (K8S / "base" / "http-server.yaml").exists()
