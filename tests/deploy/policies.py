"""Checks the schemas cannot see, as functions that list what a set of documents breaks.

Each returns a list of sentences (empty: the documents pass), so the tests can
show both that the manifests pass and that a bad manifest is caught.
"""

from __future__ import annotations

import re
from typing import Any

from tests.deploy.manifests import Doc, all_containers, by_kind, pod_templates, specserve_argv

GPU = "nvidia.com/gpu"
# The public APIs: Deployment -> the one port a NetworkPolicy may open to anyone.
PUBLIC_PORTS = {"specserve-orchestrator": "grpc", "specserve-http-server": "http"}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def unlabelled_pods(docs: list[Doc], pod_monitor: Doc) -> list[str]:
    """Deployments with a port one of the PodMonitor's endpoints scrapes (the pools'
    ``metrics``, the http-servers' ``http``) whose pods the PodMonitor does not select."""
    selector = pod_monitor["spec"]["selector"]["matchLabels"]
    scraped = {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]}
    problems = []
    for name, dep in by_kind(docs, "Deployment").items():
        pod = dep["spec"]["template"]
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        if ports & scraped and not selects(selector, pod["metadata"].get("labels", {})):
            problems.append(f"Deployment {name}: pods lack the PodMonitor's labels {selector}")
    return problems


def replicas_under_hpa(docs: list[Doc]) -> list[str]:
    """Workloads an HPA scales that still pin spec.replicas (each apply would reset it)."""
    scaled = {
        h["spec"]["scaleTargetRef"]["name"]
        for h in by_kind(docs, "HorizontalPodAutoscaler").values()
    }
    return [
        f"Deployment {name} sets replicas under an HPA"
        for name, dep in by_kind(docs, "Deployment").items()
        if name in scaled and "replicas" in dep["spec"]
    ]


def _uid(ctx: dict[str, Any]) -> Any:
    return ctx.get("runAsUser")


def restricted_violations(docs: list[Doc]) -> list[str]:
    """Pod Security "restricted" and the baseline of this project, for every pod.

    Pod: runAsNonRoot with a numeric non-root UID, seccomp RuntimeDefault, no service
    account token, no host namespaces or hostPath. Every container (init too): no
    privilege escalation, ALL capabilities dropped and none added, read-only root
    filesystem, memory and ephemeral-storage requests and limits. Every emptyDir has
    a size limit.
    """
    problems = []
    for where, template in pod_templates(docs):
        spec = template["spec"]
        pod_ctx = spec.get("securityContext", {})
        if spec.get("automountServiceAccountToken") is not False:
            problems.append(f"{where}: the service-account token is mounted")
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(host):
                problems.append(f"{where}: {host}")
        for v in spec.get("volumes", []):
            if "hostPath" in v:
                problems.append(f"{where}: hostPath volume {v['name']}")
            if "emptyDir" in v and "sizeLimit" not in (v["emptyDir"] or {}):
                problems.append(f"{where}: emptyDir {v['name']} has no sizeLimit")
        for c in all_containers(spec):
            ctx = {**pod_ctx, **c.get("securityContext", {})}
            name = f"{where} container {c['name']}"
            if ctx.get("runAsNonRoot") is not True:
                problems.append(f"{name}: runAsNonRoot is not true")
            uid = _uid(ctx)
            if not isinstance(uid, int) or uid == 0:
                problems.append(f"{name}: no numeric non-root runAsUser ({uid!r})")
            if ctx.get("seccompProfile", {}).get("type") != "RuntimeDefault":
                problems.append(f"{name}: seccomp profile is not RuntimeDefault")
            if ctx.get("allowPrivilegeEscalation") is not False or ctx.get("privileged"):
                problems.append(f"{name}: privilege escalation allowed")
            caps = ctx.get("capabilities", {})
            if caps.get("drop") != ["ALL"] or caps.get("add"):
                problems.append(f"{name}: capabilities not dropped (ALL)")
            if ctx.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{name}: root filesystem is writable")
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                for key in ("memory", "ephemeral-storage"):
                    if key not in res.get(part, {}):
                        problems.append(f"{name}: no {key} in resources.{part}")
    return problems


def writable_paths(template: Doc, c: Doc) -> list[str]:
    """Mount paths of the container that are emptyDirs (writable scratch)."""
    empty = {v["name"] for v in template["spec"].get("volumes", []) if "emptyDir" in v}
    return [
        m["mountPath"]
        for m in c.get("volumeMounts", [])
        if m["name"] in empty and not m.get("readOnly")
    ]


def unwritable_caches(docs: list[Doc]) -> list[str]:
    """specserve containers whose HOME or TORCH_EXTENSIONS_DIR is not on a writable mount."""
    problems = []
    for where, template in pod_templates(docs):
        for c in template["spec"]["containers"]:
            argv = specserve_argv(c)
            if argv is None:
                continue
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            mounts = writable_paths(template, c)
            # Only the model servers run the engine's kernels (and their JIT cache).
            kernels = argv[0] in ("draft-server", "target-server")
            for var in ("HOME", "TORCH_EXTENSIONS_DIR")[: 1 + kernels]:
                path = env.get(var)
                if path is None or not any(
                    path == m or path.startswith(m.rstrip("/") + "/") for m in mounts
                ):
                    problems.append(f"{where} {c['name']}: {var}={path} is not on a writable mount")
    return problems


def _ports(rule: Doc) -> set[Any]:
    return {p["port"] for p in rule.get("ports", [])}


def network_gaps(docs: list[Doc], monitoring_ns: str = "monitoring") -> list[str]:
    """Pods no policy covers, and ingress wider than the design (see network-policies.yaml).

    A default-deny for every pod; draft, target and Redis take their service port from
    orchestrator pods only; metrics come only from the monitoring namespace. The public
    pools (the orchestrators' gRPC, the http-servers' HTTP: ``PUBLIC_PORTS``) may admit
    anyone, to that one port only.
    """
    policies = list(by_kind(docs, "NetworkPolicy").values())
    problems = []
    if not any(p["spec"]["podSelector"] == {} and not p["spec"].get("ingress") for p in policies):
        problems.append("no default-deny ingress policy")
    orchestrator = {"app.kubernetes.io/name": "specserve-orchestrator"}
    for where, template in pod_templates(docs):
        labels = template["metadata"].get("labels", {})
        mine = [
            p
            for p in policies
            if p["spec"]["podSelector"]
            and selects(p["spec"]["podSelector"].get("matchLabels", {}), labels)
        ]
        if where.startswith("Job/"):
            continue  # only the default deny: nothing connects to the fetch Job
        if not mine:
            problems.append(f"{where}: no NetworkPolicy selects its pods")
            continue
        public = PUBLIC_PORTS.get(labels.get("app.kubernetes.io/name", ""))
        if public is not None:
            for policy in mine:
                for rule in policy["spec"].get("ingress", []):
                    if not rule.get("from") and _ports(rule) != {public}:
                        ports = sorted(map(str, _ports(rule))) or "every port"
                        problems.append(
                            f"{where}: {policy['metadata']['name']} admits anyone to {ports}"
                        )
            continue
        for policy in mine:
            for rule in policy["spec"].get("ingress", []):
                sources = rule.get("from", [])
                if not sources:
                    problems.append(f"{where}: {policy['metadata']['name']} admits anyone")
                for src in sources:
                    if "metrics" in _ports(rule):
                        ns = src.get("namespaceSelector", {}).get("matchLabels", {})
                        ok = ns == {"kubernetes.io/metadata.name": monitoring_ns}
                    else:
                        ok = src.get("podSelector", {}).get("matchLabels") == orchestrator
                        ok = ok and "namespaceSelector" not in src
                    if not ok:
                        problems.append(f"{where}: {policy['metadata']['name']} admits {src}")
    return problems


def gpus_requested(c: Doc) -> int:
    res = c.get("resources", {})
    return int(res.get("limits", {}).get(GPU, res.get("requests", {}).get(GPU, 0)))


def memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (Ki/Mi/Gi or k/M/G) in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "k": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|k|M|G)?", quantity)
    assert m, quantity
    return int(m.group(1)) * units.get(m.group(2) or "", 1)


def redis_bytes(value: str) -> int:
    """A redis.conf memory value (1gb, 768mb, 100kb, bytes) in bytes."""
    units = {"kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "k": 1000, "m": 10**6, "g": 10**9}
    m = re.fullmatch(r"(\d+)([kmg]b?)?", value.lower())
    assert m, value
    return int(m.group(1)) * units.get(m.group(2) or "", 1)


def redis_problems(docs: list[Doc]) -> list[str]:
    """Redis containers without --maxmemory below their limit, a password from a Secret,
    or a pinned image tag."""
    problems = []
    for where, template in pod_templates(docs):
        for c in template["spec"]["containers"]:
            if not c["image"].split(":")[0].endswith("redis"):
                continue
            args = c.get("args", [])
            limit = memory_bytes(c["resources"]["limits"]["memory"])
            if "--maxmemory" not in args:
                problems.append(f"{where}: Redis without --maxmemory")
            elif not redis_bytes(args[args.index("--maxmemory") + 1]) < limit:
                problems.append(f"{where}: --maxmemory is not below the memory limit")
            if "--requirepass" not in args:
                problems.append(f"{where}: Redis without a password")
            else:
                ref = re.fullmatch(r"\$\((\w+)\)", args[args.index("--requirepass") + 1])
                env = {e["name"]: e for e in c.get("env", [])}
                if not ref or "secretKeyRef" not in env.get(ref.group(1), {}).get("valueFrom", {}):
                    problems.append(f"{where}: the Redis password is not from a Secret")
            tag = c["image"].partition(":")[2]
            if not re.fullmatch(r"\d+\.\d+\.\d+(-\w+)?", tag):
                problems.append(f"{where}: Redis image tag {tag!r} is not pinned")
    return problems
