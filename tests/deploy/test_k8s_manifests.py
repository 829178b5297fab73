"""The Kubernetes manifests agree with the code they run.

Every container command is parsed by the real ``specserve`` argument parser with
the container's environment and turned into its config (so a renamed flag or a bad
value fails here, not in a cluster); Services select pods and name ports that
exist; probes and the orchestrator's DNS endpoints point at the ports the servers
bind; the HPAs read metrics the servers export. The overlays are rendered with
``kubectl kustomize`` where kubectl is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from specserve.cli import build_parser
from specserve.serving.launch import ServerProcess
from tests.orchestrator.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
BASE_FILES = ["draft.yaml", "target.yaml", "orchestrator.yaml", "autoscaling.yaml"]
OVERLAYS = ["cpu", "gpu"]
SUBCOMMAND_OF_MODULE = {
    "specserve.target_service": "target-server",
    "specserve.draft_service": "draft-server",
}


def load_docs(paths: list[Path]) -> list[dict[str, Any]]:
    return [d for p in paths for d in yaml.safe_load_all(p.read_text()) if d]


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, dep in by_kind(docs, "Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            yield name, c


def container_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment; values from Secrets or fields get a stand-in."""
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "secretKeyRef" in e.get("valueFrom", {}):
            env[e["name"]] = "redis://stand-in:6379/0"
        else:
            env[e["name"]] = "stand-in"
    return env


def specserve_argv(c: dict[str, Any]) -> list[str] | None:
    """The ``specserve`` argv a container runs (through torchrun too), or None."""
    argv = [*c.get("command", []), *c.get("args", [])]
    if argv[:1] == ["specserve"]:
        return argv[1:]
    if argv[:1] == ["torchrun"] and "-m" in argv:
        i = argv.index("-m")
        return [SUBCOMMAND_OF_MODULE[argv[i + 1]], *argv[i + 2 :]]
    return None


def parse(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """Parse ``argv`` as the container would and build the process's config."""
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        args = build_parser().parse_args(argv)
    sub = argv[0]
    if sub == "draft-server":
        from specserve.draft_service import config
    elif sub == "target-server":
        from specserve.target_service import config  # type: ignore[no-redef]
    elif sub == "orchestrator":
        from specserve.orchestrator import config  # type: ignore[no-redef]
    else:
        return args
    return args, config.from_args(args)


def check_docs(docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    deployments = by_kind(docs, "Deployment")
    services = by_kind(docs, "Service")
    bound: dict[str, int] = {}  # deployment -> gRPC port its server binds
    for dep_name, c in containers(docs):
        argv = specserve_argv(c)
        if argv is None:
            continue
        args, _config = parse(argv, container_env(c), monkeypatch)
        assert args.host == "0.0.0.0", f"{dep_name} must bind every interface in a pod"
        bound[dep_name] = args.port
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == args.port, f"{dep_name}: container port != --port"
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                assert c[probe]["grpc"]["port"] == args.port, f"{dep_name} {probe}"
        metrics_port = container_env(c).get("SPECSERVE_METRICS_PORT")
        assert metrics_port is not None and int(metrics_port) == ports["metrics"], dep_name
        # Drain time: the pod must outlive the server's own grace period.
        grace = deployments[dep_name]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > args.grace_s, f"{dep_name}: terminationGracePeriodSeconds <= --grace-s"
        # init containers fetch the model the server is told to load
        for init in deployments[dep_name]["spec"]["template"]["spec"].get("initContainers", []):
            assert init["command"][:3] == ["specserve", "models", "fetch"], init["name"]
            wanted = init["command"][3].removeprefix("$(").removesuffix(")")
            assert container_env(init)[wanted] == container_env(c)[wanted], init["name"]

    for svc_name, svc in services.items():
        selected = [
            d
            for d in deployments.values()
            if svc["spec"]["selector"].items()
            <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, f"Service {svc_name} selects {len(selected)} Deployments"
        pod_ports = {
            p["name"]
            for c in selected[0]["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]
        }
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in pod_ports, f"Service {svc_name} port {port['name']}"

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
        yield names
    finally:
        for proc in procs:
            proc.stop()


def hpa_metrics_exported(docs: list[dict[str, Any]], exported: set[str]) -> None:
    """Every per-pod HPA metric is served, or derived by the adapter from served ones."""
    rules = yaml.safe_load((K8S / "monitoring" / "adapter-rules.yaml").read_text())["rules"]
    derived = {
        r["name"]["as"]: re.findall(r"specserve_\w+", r["metricsQuery"])
        for r in rules
        if "$" not in r["name"]["as"]
    }
    for hpa_name, hpa in by_kind(docs, "HorizontalPodAutoscaler").items():
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] != "Pods":
                continue
            name = metric["pods"]["metric"]["name"]
            sources = derived.get(name, [name])
            missing = [m for m in sources if m not in exported]
            assert not missing, f"HPA {hpa_name} reads {name}; not served: {missing}"


def test_base_manifests_match_the_code(monkeypatch: pytest.MonkeyPatch, exported: set[str]) -> None:
    docs = load_docs([K8S / "base" / f for f in BASE_FILES])
    check_docs(docs, monkeypatch)
    hpa_metrics_exported(docs, exported)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_render_and_match_the_code(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(overlay)
    check_docs(docs, monkeypatch)
    assert all(
        d["metadata"].get("namespace") == "specserve" for d in docs if d["kind"] != "Namespace"
    )


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
def test_gpu_overlay_runs_a_tp2_target_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render("gpu")
    (target,) = [c for n, c in containers(docs) if n == "specserve-target"]
    argv = specserve_argv(target)
    assert argv is not None and target["command"][0] == "torchrun"
    args, config = parse(argv, container_env(target), monkeypatch)
    nproc = next(a for a in target["command"] if a.startswith("--nproc-per-node="))
    assert config.tp.world_size == int(nproc.split("=")[1]) == 2
    assert target["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert args.dtype == "bfloat16"


def test_every_kustomization_names_files_that_exist() -> None:
    for k in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(k.read_text())
        names = [*spec.get("resources", [])]
        names += [p["path"] for p in spec.get("patches", []) if "path" in p]
        names += [f for g in spec.get("configMapGenerator", []) for f in g.get("files", [])]
        for name in names:
            assert (k.parent / name).exists(), f"{k.relative_to(ROOT)} names missing {name}"


def test_bad_flags_in_a_manifest_would_be_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is not vacuous: a misspelt flag makes the parser exit."""
    with pytest.raises(SystemExit):
        parse(["target-server", "--prot", "1"], {"SPECSERVE_TARGET": "tiny:1"}, monkeypatch)
