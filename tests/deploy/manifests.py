"""Reading the Kubernetes manifests as the cluster would: rendered, then walked.

Rendering needs ``kubectl`` (its built-in kustomize); the tests that render skip
cleanly without it. Helpers here only read documents; the checks live in the tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ["cpu", "gpu"]
# The pod-carrying kinds and where their pod spec sits.
POD_TEMPLATE_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
SUBCOMMAND_OF_MODULE = {
    "specserve.target_service": "target-server",
    "specserve.draft_service": "draft-server",
}

Doc = dict[str, Any]

needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed"
)


def load_docs(paths: list[Path]) -> list[Doc]:
    return [d for p in paths for d in yaml.safe_load_all(p.read_text()) if d]


def render(path: Path) -> list[Doc]:
    """``kubectl kustomize path`` as documents."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, check=True, timeout=60
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render_overlay(overlay: str) -> list[Doc]:
    return render(K8S / "overlays" / overlay)


def by_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_templates(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    """(``Kind/name``, pod template) of every workload."""
    for d in docs:
        if d["kind"] in POD_TEMPLATE_KINDS:
            yield f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]


def all_containers(pod_spec: Doc) -> list[Doc]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def containers(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    """(Deployment name, container) of every Deployment's main containers."""
    for name, dep in by_kind(docs, "Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            yield name, c


def container_env(c: Doc) -> dict[str, str]:
    """The container's environment; values from Secrets or fields get a stand-in."""
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "secretKeyRef" in e.get("valueFrom", {}):
            key = e["valueFrom"]["secretKeyRef"]["key"]
            env[e["name"]] = "redis://stand-in:6379/0" if key == "url" else "stand-in"
        else:
            env[e["name"]] = "stand-in"
    return env


def specserve_argv(c: Doc) -> list[str] | None:
    """The ``specserve`` argv a container runs (through torchrun too), or None."""
    argv = [*c.get("command", []), *c.get("args", [])]
    if argv[:1] == ["specserve"]:
        return argv[1:]
    if argv[:1] == ["torchrun"] and "-m" in argv:
        i = argv.index("-m")
        return [SUBCOMMAND_OF_MODULE[argv[i + 1]], *argv[i + 2 :]]
    return None


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of command and args from the container's env."""
    out = []
    for a in argv:
        for name, value in env.items():
            a = a.replace(f"$({name})", value)
        out.append(a)
    return out


def cli_args(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    """The real ``specserve`` parser's reading of ``argv`` with the container's environment
    (flags default from ``SPECSERVE_*`` variables, so both forms are read alike)."""
    from specserve.cli import build_parser

    with mock.patch.dict(os.environ, env):
        return build_parser().parse_args(expand(argv, env))


def throwaway_overlay(directory: Path, overlay: str, components: list[str]) -> Path:
    """A kustomization in ``directory`` of ``k8s/overlays/<overlay>`` with the named
    ``k8s/components``, for rendering combinations no overlay in the repository has."""
    directory.mkdir(parents=True, exist_ok=True)
    rel = Path(os.path.relpath(K8S, directory))
    spec = {
        "namespace": "specserve",
        "resources": [str(rel / "overlays" / overlay)],
        "components": [str(rel / "components" / c) for c in components],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    return directory
