"""The TLS, API-key and cert-manager components, rendered as an operator composes them.

With the TLS component every gRPC server (draft, target, orchestrator) gets a
certificate, a key and a CA from a Secret mounted read-only, and every probe goes to
the plaintext health port; with the API-key component the orchestrator reads
``--api-keys-file`` from a mounted Secret; the NetworkPolicies admit the health port
to no pod (the kubelet probes from the node, which policies always admit) and the
metrics port only from monitoring; the cert-manager Certificates write the Secrets the
pods mount, with the names the orchestrators check. The composed overlays also pass
the checks against the real CLI and the security profile. Every check is then fed a
manifest that breaks it and must complain.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tests.deploy import policies, tls_policies
from tests.deploy.manifests import (
    Doc,
    by_kind,
    needs_kubectl,
    render,
    render_overlay,
    throwaway_overlay,
)
from tests.deploy.secret_mounts import StandIns
from tests.deploy.test_k8s_manifests import check_docs

pytestmark = needs_kubectl

TLS_AND_KEYS = {
    "gpu": ("gpu", []),  # the production-like overlay has both components
    "cpu+tls+api-keys": ("cpu", ["tls", "api-keys"]),
    "cpu+cert-manager+tls+api-keys": ("cpu", ["cert-manager", "tls", "api-keys"]),
}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Doc]]:
    out = {}
    for name, (overlay, components) in TLS_AND_KEYS.items():
        if not components:
            out[name] = render_overlay(overlay)
            continue
        here = throwaway_overlay(tmp_path_factory.mktemp(name), overlay, components)
        out[name] = render(here)
    return out


def pool(docs: list[Doc], name: str) -> Doc:
    return by_kind(docs, "Deployment")[f"specserve-{name}"]["spec"]["template"]["spec"]


def env_of(docs: list[Doc], name: str) -> list[Doc]:
    env: list[Doc] = pool(docs, name)["containers"][0]["env"]
    return env


def test_composed_overlays_match_the_code(
    secured: dict[str, list[Doc]], monkeypatch: pytest.MonkeyPatch, stand_ins: StandIns
) -> None:
    """Every flag exists in the real CLI and the configs build from the mounted files."""
    for docs in secured.values():
        check_docs(docs, monkeypatch, stand_ins)


def test_every_grpc_server_has_tls_and_is_probed_on_the_health_port(
    secured: dict[str, list[Doc]],
) -> None:
    for name, docs in secured.items():
        assert tls_policies.tls_gaps(docs) == [], name
    # Not vacuous: the plain cpu overlay has none of it, for each of the three pools.
    gaps = tls_policies.tls_gaps(render_overlay("cpu"))
    for pool_name in ("draft", "target", "orchestrator"):
        assert f"specserve-{pool_name}: no --tls-cert" in gaps
        assert any(g.startswith(f"specserve-{pool_name}: TLS without --health-port") for g in gaps)


def test_the_orchestrator_reads_api_keys_from_a_secret(secured: dict[str, list[Doc]]) -> None:
    for name, docs in secured.items():
        assert tls_policies.api_key_gaps(docs) == [], name
    assert tls_policies.api_key_gaps(render_overlay("cpu")) == [
        "specserve-orchestrator: no --api-keys-file"
    ]


def test_replicas_take_calls_only_from_the_orchestrators(
    secured: dict[str, list[Doc]],
) -> None:
    """Every overlay: mutual TLS (gpu, +tls) or the internal token (cpu) on every gRPC
    server; taking the token away from the cpu overlay's target is caught."""
    cpu = render_overlay("cpu")
    for name, docs in [*secured.items(), ("cpu", cpu)]:
        assert tls_policies.replica_auth_gaps(docs) == [], name
    broken = copy.deepcopy(cpu)
    target = pool(broken, "target")["containers"][0]
    target["env"] = [e for e in target["env"] if e["name"] != "SPECSERVE_INTERNAL_TOKEN_FILE"]
    assert tls_policies.replica_auth_gaps(broken) == [
        "specserve-target: neither mutual TLS nor --internal-token-file"
    ]


def test_secrets_are_read_only_and_policies_still_hold(secured: dict[str, list[Doc]]) -> None:
    for name, docs in [*secured.items(), ("cpu", render_overlay("cpu"))]:
        assert tls_policies.writable_secrets(docs) == [], name
        assert tls_policies.health_port_admitted(docs) == [], name
        assert policies.network_gaps(docs) == [], name
        assert policies.restricted_violations(docs) == [], name
        assert policies.unwritable_caches(docs) == [], name
    secret_volumes = [v for v in pool(secured["gpu"], "orchestrator")["volumes"] if "secret" in v]
    assert {v["secret"]["secretName"] for v in secret_volumes} == {
        "specserve-orchestrator-tls",
        "specserve-api-keys",
    }


def test_the_certificates_fit_the_pods(secured: dict[str, list[Doc]]) -> None:
    docs = secured["cpu+cert-manager+tls+api-keys"]
    assert tls_policies.certificate_gaps(docs) == []
    assert all(
        d["metadata"].get("namespace") == "specserve" for d in docs if d["kind"] != "Namespace"
    )
    # Without the component no Certificate writes the pools' Secrets (the http-server's
    # CA Secret included).
    assert len(tls_policies.certificate_gaps(secured["gpu"])) == 4


def test_missing_or_misplaced_tls_would_be_caught(secured: dict[str, list[Doc]]) -> None:
    docs = copy.deepcopy(secured["gpu"])
    draft, target, orch = (pool(docs, n) for n in ("draft", "target", "orchestrator"))
    draft["containers"][0]["env"] = [
        e for e in draft["containers"][0]["env"] if e["name"] != "SPECSERVE_TLS_CA"
    ]
    target["containers"][0]["readinessProbe"]["grpc"]["port"] = 50061
    for e in orch["containers"][0]["env"]:
        if e["name"] == "SPECSERVE_TLS_CERT":
            e["value"] = "/tmp/tls.crt"  # on the emptyDir, not from a Secret
    gaps = tls_policies.tls_gaps(docs)
    assert "specserve-draft: no --tls-ca" in gaps
    assert "specserve-target readinessProbe: port 50061, not the health port 8081" in gaps
    assert any("--tls-cert /tmp/tls.crt is not a file of a mounted Secret" in g for g in gaps)
    assert len(gaps) == 3, gaps


def test_a_misspelt_variable_or_a_writable_mount_would_be_caught(
    secured: dict[str, list[Doc]],
) -> None:
    docs = copy.deepcopy(secured["gpu"])
    for e in env_of(docs, "target"):
        if e["name"] == "SPECSERVE_TLS_CERT":
            e["name"] = "SPECSERVE_TLS_CRT"  # the parser ignores it: no certificate
    for e in env_of(docs, "draft"):
        if e["name"] == "SPECSERVE_HEALTH_PORT":
            e["name"] = "SPECSERVE_HEALTHPORT"
    for m in pool(docs, "orchestrator")["containers"][0]["volumeMounts"]:
        m.pop("readOnly", None)
    gaps = tls_policies.tls_gaps(docs)
    assert "specserve-target: no --tls-cert" in gaps
    assert any(g.startswith("specserve-draft: TLS without --health-port") for g in gaps)
    assert (
        "specserve-orchestrator: --tls-key /etc/specserve/tls/tls.key is mounted writable" in gaps
    )
    assert any("api-keys is mounted writable" in g for g in tls_policies.api_key_gaps(docs))
    writable = tls_policies.writable_secrets(docs)
    assert sorted(writable) == [
        "Deployment/specserve-orchestrator orchestrator: api-keys is writable",
        "Deployment/specserve-orchestrator orchestrator: tls is writable",
    ]


def test_flags_in_args_count_like_their_variables(secured: dict[str, list[Doc]]) -> None:
    """The checks read the real parser's result: the same setting as a flag passes too."""
    docs = copy.deepcopy(secured["gpu"])
    c = pool(docs, "draft")["containers"][0]
    c["env"] = [
        e for e in c["env"] if e["name"] not in ("SPECSERVE_TLS_CA", "SPECSERVE_HEALTH_PORT")
    ]
    assert len(tls_policies.tls_gaps(docs)) == 2
    c["args"] += ["--tls-ca", "/etc/specserve/tls/ca.crt", "--health-port", "8081"]
    assert tls_policies.tls_gaps(docs) == []


def test_api_keys_outside_a_secret_would_be_caught(secured: dict[str, list[Doc]]) -> None:
    docs = copy.deepcopy(secured["gpu"])
    env = env_of(docs, "orchestrator")
    (keys,) = [e for e in env if e["name"] == "SPECSERVE_API_KEYS_FILE"]
    keys["value"] = "/models/api-keys"
    assert tls_policies.api_key_gaps(docs) == [
        "specserve-orchestrator: --api-keys-file /models/api-keys is not a file of a mounted Secret"
    ]
    env.remove(keys)
    assert tls_policies.api_key_gaps(docs) == ["specserve-orchestrator: no --api-keys-file"]


def test_world_readable_secrets_would_be_caught(secured: dict[str, list[Doc]]) -> None:
    docs = copy.deepcopy(secured["gpu"])
    for v in pool(docs, "target")["volumes"]:
        if "secret" in v:
            v["secret"]["defaultMode"] = 0o644
    assert tls_policies.writable_secrets(docs) == [
        "Deployment/specserve-target: Secret volume tls is world-readable"
    ]


def test_a_policy_opening_the_health_port_would_be_caught(secured: dict[str, list[Doc]]) -> None:
    docs = copy.deepcopy(secured["gpu"])
    netpols = by_kind(docs, "NetworkPolicy")
    netpols["specserve-target"]["spec"]["ingress"].append(
        {"ports": [{"port": "health", "protocol": "TCP"}]}
    )
    netpols["specserve-draft"]["spec"]["ingress"][0].pop("ports")  # every port, orchestrators
    found = tls_policies.health_port_admitted(docs)
    assert len(found) == 2 and {f.split(":")[0] for f in found} == {
        "Deployment specserve-target",
        "Deployment specserve-draft",
    }, found


def test_certificates_that_do_not_fit_would_be_caught(secured: dict[str, list[Doc]]) -> None:
    docs = copy.deepcopy(secured["cpu+cert-manager+tls+api-keys"])
    certs = by_kind(docs, "Certificate")
    certs["specserve-target"]["spec"]["dnsNames"].remove("specserve-target")
    certs["specserve-orchestrator"]["spec"]["usages"].remove("client auth")
    certs["specserve-draft"]["spec"]["issuerRef"]["name"] = "nowhere"
    assert sorted(tls_policies.certificate_gaps(docs)) == [
        "Certificate for specserve-orchestrator: no client auth for the replicas",
        "Certificate for specserve-target lacks the name dialled: specserve-target",
        "Certificate specserve-draft: issuer nowhere missing",
    ]


def test_a_tls_server_probed_on_its_tls_port_fails_the_cli_check(
    secured: dict[str, list[Doc]], monkeypatch: pytest.MonkeyPatch, stand_ins: StandIns
) -> None:
    docs = copy.deepcopy(secured["cpu+tls+api-keys"])
    pool(docs, "orchestrator")["containers"][0]["livenessProbe"]["grpc"]["port"] = 50051
    with pytest.raises(AssertionError, match="specserve-orchestrator livenessProbe"):
        check_docs(docs, monkeypatch, stand_ins)


def test_the_component_files_are_what_the_doc_names() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md").read_text()
    for name in ("tls", "api-keys", "cert-manager", "internal-token"):
        assert f"components/{name}" in doc


def test_a_service_exposing_the_health_port_fails_the_cli_check(
    secured: dict[str, list[Doc]], monkeypatch: pytest.MonkeyPatch, stand_ins: StandIns
) -> None:
    docs = copy.deepcopy(secured["cpu+tls+api-keys"])
    by_kind(docs, "Service")["specserve-target"]["spec"]["ports"].append(
        {"name": "health", "port": 8081, "targetPort": "health"}
    )
    with pytest.raises(AssertionError, match="the health port is for the kubelet"):
        check_docs(docs, monkeypatch, stand_ins)
