"""What an operator checks that the schemas cannot: the rendered overlays (and the
optional monitoring and gateway pieces) against the metrics path, the security
baseline, network policy, GPU use, Redis limits, the images built, and the
Kubernetes API schemas (kubernetes-validate, strict) from 1.25 to 1.37.

Each check is a function in :mod:`tests.deploy.policies` that lists problems; the
``*_would_be_caught`` tests feed it a manifest of the old kind and see it complain.
"""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from specserve.cli import build_parser
from tests.deploy import policies
from tests.deploy.manifests import (
    K8S,
    OVERLAYS,
    ROOT,
    Doc,
    by_kind,
    container_env,
    expand,
    needs_kubectl,
    pod_templates,
    render,
    render_overlay,
    specserve_argv,
    throwaway_overlay,
)
from tests.deploy.secret_mounts import StandIns

pytestmark = needs_kubectl
K8S_VERSIONS = ("1.25.0", "1.30.0", "1.37.0")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    return {overlay: render_overlay(overlay) for overlay in OVERLAYS}


def the_pod_monitor() -> Doc:
    (pm,) = by_kind(render(K8S / "monitoring"), "PodMonitor").values()
    return pm


def test_every_pool_carries_the_podmonitor_labels(rendered: dict[str, list[Doc]]) -> None:
    pm = the_pod_monitor()
    assert pm["metadata"]["labels"].get("release"), "kube-prometheus-stack selects on release"
    for docs in rendered.values():
        assert policies.unlabelled_pods(docs, pm) == []
        pools = [d for d in by_kind(docs, "Deployment") if d.startswith("specserve-")]
        assert {
            "specserve-draft",
            "specserve-target",
            "specserve-orchestrator",
            "specserve-http-server",  # scraped on its HTTP port
        } <= set(pools)


def test_missing_template_labels_would_be_caught(rendered: dict[str, list[Doc]]) -> None:
    docs = copy.deepcopy(rendered["cpu"])
    for dep in by_kind(docs, "Deployment").values():
        dep["spec"]["template"]["metadata"]["labels"].pop("app.kubernetes.io/part-of", None)
    assert len(policies.unlabelled_pods(docs, the_pod_monitor())) == 4


def test_no_replicas_on_hpa_targets(rendered: dict[str, list[Doc]]) -> None:
    for docs in rendered.values():
        assert policies.replicas_under_hpa(docs) == []
        hpas = by_kind(docs, "HorizontalPodAutoscaler")
        assert hpas["specserve-target"]["spec"]["minReplicas"] >= 2
    pinned = copy.deepcopy(rendered["cpu"])
    by_kind(pinned, "Deployment")["specserve-draft"]["spec"]["replicas"] = 1
    assert len(policies.replicas_under_hpa(pinned)) == 1


def test_every_pod_and_container_is_restricted(rendered: dict[str, list[Doc]]) -> None:
    for docs in rendered.values():
        assert policies.restricted_violations(docs) == []
        assert policies.unwritable_caches(docs) == []
    cpu = rendered["cpu"]
    (ns,) = by_kind(cpu, "Namespace").values()
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_an_unhardened_pod_would_be_caught(rendered: dict[str, list[Doc]]) -> None:
    docs = copy.deepcopy(rendered["cpu"])
    dep = by_kind(docs, "Deployment")["specserve-draft"]
    spec = dep["spec"]["template"]["spec"]
    spec.pop("securityContext")
    spec.pop("automountServiceAccountToken")
    for c in spec["containers"]:
        c.pop("securityContext")
        c["env"] = [e for e in c["env"] if e["name"] not in ("HOME", "TORCH_EXTENSIONS_DIR")]
    found = policies.restricted_violations([dep])
    assert any("token" in p for p in found) and any("runAsNonRoot" in p for p in found)
    assert any("capabilities" in p for p in found) and any("root filesystem" in p for p in found)
    assert len(policies.unwritable_caches([dep])) == 2


def test_network_policies_cover_every_pool(rendered: dict[str, list[Doc]]) -> None:
    for overlay, docs in rendered.items():
        assert policies.network_gaps(docs) == [], overlay
    # Redis (cpu overlay) is covered too, and an open policy would be reported.
    docs = copy.deepcopy(rendered["cpu"])
    by_kind(docs, "NetworkPolicy")["specserve-target"]["spec"]["ingress"][0].pop("from")
    del by_kind(docs, "NetworkPolicy")["specserve-redis"]["metadata"]["name"]
    docs = [d for d in docs if d["metadata"].get("name") is not None]
    gaps = policies.network_gaps(docs)
    assert any("specserve-redis: no NetworkPolicy" in g for g in gaps), gaps
    assert any("admits anyone" in g for g in gaps), gaps


def uses_cuda(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether the process the container starts runs its model on CUDA, per the real CLI:
    its ``--device`` (``SPECSERVE_DEVICE``), which a target's TP ranks follow too
    (``cuda:LOCAL_RANK``); a TP backend that contradicts it is refused
    (tests/services/test_config.py)."""
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        args = build_parser().parse_args(expand(argv, env))
    return str(getattr(args, "device", "cpu")).startswith("cuda")  # the orchestrator: none


def test_a_requested_gpu_implies_a_cuda_process(
    rendered: dict[str, list[Doc]], monkeypatch: pytest.MonkeyPatch, stand_ins: StandIns
) -> None:
    requested: dict[str, int] = {}
    for overlay, docs in rendered.items():
        for where, template in pod_templates(docs):
            for c in template["spec"]["containers"]:
                gpus = policies.gpus_requested(c)
                argv = specserve_argv(c)
                if argv is None:
                    continue
                local = stand_ins.local_paths(template["spec"], c)  # the TLS files
                env = {k: local.get(v, v) for k, v in container_env(c).items()}
                cuda = uses_cuda(argv, env, monkeypatch)
                assert cuda == (gpus > 0), f"{where}: {gpus} GPUs for a {argv[0]} on CUDA={cuda}"
                if gpus == 0:
                    continue
                requested[f"{overlay}/{argv[0]}"] = gpus
                if argv[0] == "target-server":
                    nproc = [a for a in c["command"] if a.startswith("--nproc-per-node=")]
                    assert nproc == [f"--nproc-per-node={gpus}"], f"{where}: one rank per GPU"
    # The gpu overlay: a TP=2 target on two GPUs, each draft on a GPU of its own.
    assert requested == {"gpu/target-server": 2, "gpu/draft-server": 1}


def test_a_gpu_on_a_cpu_process_would_be_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"SPECSERVE_DRAFT": "tiny:1", "SPECSERVE_TARGET": "tiny:1"}
    assert not uses_cuda(["draft-server"], env, monkeypatch)
    assert uses_cuda(["draft-server", "--device", "cuda"], env, monkeypatch)
    assert not uses_cuda(["target-server", "--tp", "2", "--tp-backend", "gloo"], env, monkeypatch)
    assert uses_cuda(
        ["target-server", "--tp", "2"], {**env, "SPECSERVE_DEVICE": "cuda"}, monkeypatch
    )


def test_redis_has_maxmemory_a_secret_password_and_a_pinned_tag(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = rendered["cpu"]
    assert any(
        c["image"].startswith("redis:")
        for _, t in pod_templates(docs)
        for c in t["spec"]["containers"]
    )
    assert policies.redis_problems(docs) == []
    old = yaml.safe_load(
        """
        kind: Deployment
        metadata: {name: redis}
        spec:
          template:
            spec:
              containers:
                - name: redis
                  image: redis:7-alpine
                  args: ["--maxmemory-policy", "volatile-ttl"]
                  resources: {limits: {memory: 1Gi}}
        """
    )
    assert len(policies.redis_problems([old])) == 3


def built_images() -> set[str]:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build-images.sh"), "--print-tags"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return set(out.stdout.split())


def test_the_images_named_are_the_images_built(rendered: dict[str, list[Doc]]) -> None:
    built = built_images()
    assert built == {
        "ghcr.io/specserve/specserve:0.1.0-cpu",
        "ghcr.io/specserve/specserve:0.1.0-cuda",
    }
    for overlay, docs in rendered.items():
        named = {
            c["image"]
            for _, t in pod_templates(docs)
            for c in [*t["spec"].get("initContainers", []), *t["spec"]["containers"]]
            if not c["image"].startswith("redis:")
        }
        assert named and named <= built, f"{overlay} runs images nothing builds: {named - built}"
    # One torch pin: the image build and the Makefile's CPU wheel.
    script = (ROOT / "scripts" / "build-images.sh").read_text()
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r'TORCH_VERSION="([\d.]+)"', script)
    assert pin and f"torch=={pin.group(1)}" in makefile


def test_the_dockerfile_runs_as_a_numeric_user_without_compilers() -> None:
    stages = re.split(r"^FROM ", (ROOT / "Dockerfile").read_text(), flags=re.M)[1:]
    assert len(stages) >= 2, "multi-stage"
    runtime = stages[-1]
    assert re.search(r"^USER \d+:\d+$", runtime, re.M), "a numeric USER"
    compilers = re.compile(r"(?<![\w-])(g\+\+|gcc|clang|build-essential)(?![\w-])")
    assert compilers.search(stages[0]) and not compilers.search(runtime), "compilers: builder only"
    assert "kernel_prebuild" in stages[0] and "/opt/specserve/torch-extensions" in runtime
    # Dependencies install before the source is copied (layer caching).
    builder = stages[0]
    assert builder.index("requirements.txt") < builder.index("COPY specserve")


# Custom resources: the validator has no schemas for them (their operators validate).
CRD_KINDS = {"GRPCRoute", "HTTPRoute", "PodMonitor", "Certificate", "Issuer"}
# Overlays with the optional components, as an operator would compose them.
COMPOSED = {
    "cpu+gateway": ("cpu", ["gateway"]),
    "cpu+cert-manager+tls+api-keys+gateway": (
        "cpu",
        ["cert-manager", "tls", "api-keys", "gateway"],
    ),
}


def to_validate(docs: list[Doc]) -> list[Doc]:
    """The documents of built-in kinds."""
    return [d for d in docs if d["kind"] not in CRD_KINDS]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_everything_validates_strictly(
    rendered: dict[str, list[Doc]], version: str, tmp_path: Path
) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    composed = [
        render(throwaway_overlay(tmp_path / name, overlay, components))
        for name, (overlay, components) in COMPOSED.items()
    ]
    kinds = {d["kind"] for docs in composed for d in docs}
    assert {"GRPCRoute", "HTTPRoute", "Certificate", "Issuer"} <= kinds
    for docs in [*rendered.values(), *composed]:
        for doc in to_validate(docs):
            kubernetes_validate.validate(doc, version, strict=True)


def test_a_misspelt_field_fails_strict_validation(rendered: dict[str, list[Doc]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    dep = copy.deepcopy(by_kind(rendered["cpu"], "Deployment")["specserve-draft"])
    dep["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)
