"""The Kubernetes manifests agree with the code they run.

Every container command is parsed by the real ``specserve`` argument parser with
the container's environment and turned into its config (so a renamed flag or a bad
value fails here, not in a cluster; files from mounted Secrets are replaced by local
stand-ins, which the config reads); Services select pods and name ports that
exist, the metrics Service each pod's /metrics port (the pools' metrics port, the
http-server's HTTP port); probes and the orchestrator's DNS endpoints point at the
ports the servers bind (a TLS server's probes at its plaintext health port); the
http-server dials the orchestrators' Service and names their model; the model-cache Job
fetches every model a pod loads into the volume the pods mount; the HPAs read
metrics the adapter derives from series the servers export.
The overlays are rendered with ``kubectl kustomize`` where kubectl is installed.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import yaml

from specserve.cli import build_parser
from specserve.serving.launch import ServerProcess
from tests.deploy import http_policies
from tests.deploy.manifests import (
    K8S,
    OVERLAYS,
    Doc,
    by_kind,
    container_env,
    containers,
    expand,
    load_docs,
    needs_kubectl,
    render_overlay,
    specserve_argv,
)
from tests.deploy.secret_mounts import StandIns
from tests.orchestrator.redis_server import free_port

BASE_FILES = [
    "model-cache.yaml",
    "draft.yaml",
    "target.yaml",
    "orchestrator.yaml",
    "http-server.yaml",
    "metrics-service.yaml",
    "autoscaling.yaml",
]
ADAPTER_VALUES = K8S / "monitoring" / "prometheus-adapter-values.yaml"
METRICS_SERVICE = "specserve-metrics"


def parse(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """Parse ``argv`` as the container would and build the process's config.

    The config is built as on the pod's node: a manifest asking for ``--device cuda``
    runs where CUDA exists, so this machine is made to report one device then (the
    device name is still checked; only the machine check is the node's).
    """
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        args = build_parser().parse_args(expand(argv, env))
    if str(getattr(args, "device", "cpu")).startswith("cuda"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    sub = argv[0]
    if sub == "draft-server":
        from specserve.draft_service import config
    elif sub == "target-server":
        from specserve.target_service import config  # type: ignore[no-redef]
    elif sub == "orchestrator":
        from specserve.orchestrator import config  # type: ignore[no-redef]
    elif sub == "http-server":
        from specserve.openai_api import config  # type: ignore[no-redef]
    else:
        return args, None
    return args, config.from_args(args)


def container_port_names(dep: Doc) -> set[str]:
    """The names of the ports a Deployment's containers declare."""
    return {
        p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
    }


def prestop_sleep_s(c: Doc) -> float:
    cmd = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(cmd[1]) if cmd[:1] == ["sleep"] else 0.0


def claim_mounts(pod_spec: Doc, c: Doc) -> dict[str, tuple[str, bool]]:
    """mountPath -> (PVC claim, read-only) for the container's PVC mounts."""
    claims = {
        v["name"]: v["persistentVolumeClaim"]
        for v in pod_spec.get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    return {
        m["mountPath"]: (claims[m["name"]]["claimName"], bool(m.get("readOnly")))
        for m in c.get("volumeMounts", [])
        if m["name"] in claims
    }


def check_http_server(dep_name: str, pod: Doc, c: Doc, args: Any, config: Any) -> None:
    """The OpenAI door: one HTTP port (the API, /health, /metrics), no metrics-port
    variable (its config refuses one; building it above checks), no model. Its probes
    and the address it dials are checked by :mod:`tests.deploy.http_policies`."""
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": args.port}, f"{dep_name}: one container port, http = --port"
    assert config.served_model_name, dep_name
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= 60 and prestop_sleep_s(c) > 0, f"{dep_name}: grace 60 s and a preStop"


def check_docs(docs: list[Doc], monkeypatch: pytest.MonkeyPatch, stand_ins: StandIns) -> None:
    deployments = by_kind(docs, "Deployment")
    services = by_kind(docs, "Service")
    bound: dict[str, int] = {}  # deployment -> the port its server binds (gRPC or HTTP)
    metrics_port_name: dict[str, str] = {}  # deployment -> the container port serving /metrics
    served_names: dict[str, str] = {}  # deployment -> the model id clients name
    models_needed: dict[str, set[str]] = {}  # store home -> models the pods load
    cache_claims: set[tuple[str, str]] = set()  # (claim, mountPath) the pods read
    for dep_name, c in containers(docs):
        argv = specserve_argv(c)
        if argv is None:
            continue
        pod = deployments[dep_name]["spec"]["template"]["spec"]
        local = stand_ins.local_paths(pod, c)
        env = {k: local.get(v, v) for k, v in container_env(c).items()}
        args, config = parse([local.get(a, a) for a in argv], env, monkeypatch)
        assert args.host == "0.0.0.0", f"{dep_name} must bind every interface in a pod"
        bound[dep_name] = args.port
        if argv[0] == "http-server":
            check_http_server(dep_name, pod, c, args, config)
            metrics_port_name[dep_name] = "http"
            served_names[dep_name] = config.served_model_name
            continue
        metrics_port_name[dep_name] = "metrics"
        if argv[0] == "orchestrator":
            served_names[dep_name] = config.model_name
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == args.port, f"{dep_name}: container port != --port"
        # The kubelet's gRPC probes speak plaintext: a TLS server's go to --health-port.
        assert not args.tls_cert or args.health_port, f"{dep_name}: TLS without --health-port"
        probed = args.port if args.health_port is None else args.health_port
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                assert c[probe]["grpc"]["port"] == probed, f"{dep_name} {probe}"
        if args.health_port is not None:
            assert ports["health"] == args.health_port, f"{dep_name}: no health container port"
        metrics_port = env.get("SPECSERVE_METRICS_PORT")
        assert metrics_port is not None and int(metrics_port) == ports["metrics"], dep_name
        # Drain time: the pod outlives the preStop pause plus the server's own drain.
        grace = pod["terminationGracePeriodSeconds"]
        assert grace >= 60 and prestop_sleep_s(c) > 0, f"{dep_name}: grace 60 s and a preStop"
        assert grace > prestop_sleep_s(c) + args.grace_s, f"{dep_name}: grace < preStop + drain"
        # The model (or tokenizer) comes from the read-only cache at SPECSERVE_HOME.
        model = getattr(args, "model", None) or getattr(args, "tokenizer", None)
        assert model, f"{dep_name} loads no model and no tokenizer"
        home = env["SPECSERVE_HOME"]
        claim, read_only = claim_mounts(pod, c)[home]
        assert read_only, f"{dep_name} must mount the model cache read-only"
        models_needed.setdefault(home, set()).add(model)
        cache_claims.add((claim, home))

    # The fill Job fetches every one of those models into that claim.
    (job,) = by_kind(docs, "Job").values()
    pod = job["spec"]["template"]["spec"]
    (fetch,) = pod["containers"]
    env = container_env(fetch)
    argv = specserve_argv(fetch)
    assert argv is not None and argv[:2] == ["models", "fetch"]
    fetch_args, _ = parse(argv, env, monkeypatch)
    for home, models in models_needed.items():
        assert env["SPECSERVE_HOME"] == home
        missing = models - set(fetch_args.targets)
        assert not missing, f"the model-cache Job does not fetch {missing}"
    for claim, home in cache_claims:
        assert claim_mounts(pod, fetch)[home] == (claim, False), "the Job writes the claim"
    (pvc,) = by_kind(docs, "PersistentVolumeClaim").values()
    # One mode every shared-file class grants; block-storage drivers refuse a claim that
    # pairs ReadWriteOnce with ReadOnlyMany, so no such pair.
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]

    for svc_name, svc in services.items():
        selected = [
            d
            for d in deployments.values()
            if svc["spec"]["selector"].items()
            <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        names = [p["name"] for p in svc["spec"]["ports"]]
        targets = {p["targetPort"] for p in svc["spec"]["ports"]}
        if svc_name == METRICS_SERVICE:
            picked = {d["metadata"]["name"] for d in selected}
            assert picked == set(bound), f"{svc_name} must select every specserve pool"
            reached: set[str] = set()
            for dep in selected:
                name, pod_ports = dep["metadata"]["name"], container_port_names(dep)
                # Each pod is an endpoint of exactly the port that serves its /metrics.
                assert targets & pod_ports == {metrics_port_name[name]}, f"{svc_name} -> {name}"
                reached |= targets & pod_ports
            assert reached == targets, f"{svc_name}: ports no pod has: {targets - reached}"
            continue
        assert len(selected) == 1, f"Service {svc_name} selects {len(selected)} Deployments"
        assert "metrics" not in names, f"{svc_name}: metrics only on the metrics Service"
        assert "health" not in names, f"{svc_name}: the health port is for the kubelet"
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in container_port_names(selected[0]), (
                f"Service {svc_name} port {port['name']}"
            )

    # The OpenAI door names the model as the orchestrators do (requests naming another
    # are refused with 404), and dials their Service on the port they bind.
    doors = {n: v for n, v in served_names.items() if n != "specserve-orchestrator"}
    for door, name in doors.items():
        assert name == served_names["specserve-orchestrator"], f"{door}: model id {name}"
    assert http_policies.orchestrator_address_gaps(docs) == []

    # The orchestrator finds the pools through headless Services on the bound ports.
    (orch,) = [c for n, c in containers(docs) if n == "specserve-orchestrator"]
    env = container_env(orch)
    for var, pool in [
        ("SPECSERVE_TARGET_ENDPOINTS", "specserve-target"),
        ("SPECSERVE_DRAFT_ENDPOINTS", "specserve-draft"),
    ]:
        host, _, port = env[var].removeprefix("dns:///").partition(":")
        assert host == pool and services[pool]["spec"]["clusterIP"] == "None", var
        assert int(port) == bound[pool], f"{var} port != the {pool} server's --port"

    for hpa_name, hpa in by_kind(docs, "HorizontalPodAutoscaler").items():
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments, hpa_name


@pytest.fixture(scope="module")
def exported() -> Iterator[set[str]]:
    """Metric names a tiny draft and a tiny target server serve on /metrics."""
    names: set[str] = set()
    procs = []
    try:
        for role, model in (("target", "tiny:3"), ("draft", "tiny:3:noise=0.3")):
            port = free_port()
            args = ["--model", model, "--threads", "1", "--kv-budget", "8MiB"]
            procs.append(ServerProcess(role, [*args, "--metrics-port", str(port)]).start())
            procs[-1].wait_serving()
            url = f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                body = r.read().decode()
            names |= set(re.findall(r"^(specserve_\w+)", body, re.M))
            # A histogram with no observation yet (no call served) has no samples.
            for family in re.findall(r"^# TYPE (specserve_\w+) histogram$", body, re.M):
                names |= {f"{family}_{s}" for s in ("bucket", "sum", "count")}
        yield names
    finally:
        for proc in procs:
            proc.stop()


def adapter_rules() -> dict[str, list[str]]:
    """HPA metric name -> the server series its prometheus-adapter rule reads."""
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    return {
        r["name"]["as"]: re.findall(r"specserve_\w+", r["seriesQuery"] + r["metricsQuery"])
        for r in rules
    }


def hpa_metrics_exported(docs: list[Doc], exported: set[str]) -> None:
    """Every per-pod HPA metric has an adapter rule, over series the servers export."""
    derived = adapter_rules()
    for hpa_name, hpa in by_kind(docs, "HorizontalPodAutoscaler").items():
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] != "Pods":
                continue
            name = metric["pods"]["metric"]["name"]
            assert name in derived, f"HPA {hpa_name} reads {name}: no adapter rule makes it"
            missing = [m for m in derived[name] if m not in exported]
            assert not missing, f"HPA {hpa_name} reads {name}; not served: {missing}"


def test_base_manifests_match_the_code(
    monkeypatch: pytest.MonkeyPatch, exported: set[str], stand_ins: StandIns
) -> None:
    docs = load_docs([K8S / "base" / f for f in BASE_FILES])
    check_docs(docs, monkeypatch, stand_ins)
    hpa_metrics_exported(docs, exported)


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_render_and_match_the_code(
    overlay: str, monkeypatch: pytest.MonkeyPatch, stand_ins: StandIns
) -> None:
    docs = render_overlay(overlay)
    check_docs(docs, monkeypatch, stand_ins)
    assert all(
        d["metadata"].get("namespace") == "specserve" for d in docs if d["kind"] != "Namespace"
    )


@needs_kubectl
def test_gpu_overlay_runs_a_tp2_target_under_torchrun(
    monkeypatch: pytest.MonkeyPatch, stand_ins: StandIns
) -> None:
    docs = render_overlay("gpu")
    (target,) = [c for n, c in containers(docs) if n == "specserve-target"]
    argv = specserve_argv(target)
    assert argv is not None and target["command"][0] == "torchrun"
    local = stand_ins.local_paths(
        by_kind(docs, "Deployment")["specserve-target"]["spec"]["template"]["spec"], target
    )
    env = {k: local.get(v, v) for k, v in container_env(target).items()}
    args, config = parse(argv, env, monkeypatch)
    nproc = next(a for a in target["command"] if a.startswith("--nproc-per-node="))
    assert config.tp.world_size == int(nproc.split("=")[1]) == 2
    assert target["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert args.dtype == "bfloat16"


def test_every_kustomization_names_files_that_exist() -> None:
    for k in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(k.read_text())
        names = [*spec.get("resources", []), *spec.get("components", [])]
        names += [p["path"] for p in spec.get("patches", []) if "path" in p]
        names += [f for g in spec.get("configMapGenerator", []) for f in g.get("files", [])]
        for name in names:
            assert (k.parent / name).exists(), f"{k.relative_to(K8S.parent)} names missing {name}"


def test_bad_flags_in_a_manifest_would_be_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is not vacuous: a misspelt flag makes the parser exit."""
    with pytest.raises(SystemExit):
        parse(["target-server", "--prot", "1"], {"SPECSERVE_TARGET": "tiny:1"}, monkeypatch)
