"""The alert rules (k8s/monitoring/alerts.yaml) ask for series the code exports, and
every alert points at a runbook section that exists.

The metric names are read from the collectors' source, as the servers build them
(``f"{P}_name"`` in the orchestrator and the HTTP server, ``f"{p}_name"`` per pool in
the replicas); a counter is scraped with ``_total``, a histogram as
``_bucket``/``_sum``/``_count``. The rules file is rendered with ``kubectl kustomize``
and every alert has a severity, a summary, a well-formed ``for`` where it has one,
and a runbook link; each process the manifests deploy has an alert on its series.
"""

from __future__ import annotations

import re

from tests.deploy.manifests import K8S, ROOT, Doc, by_kind, needs_kubectl, render
from tests.test_docs_links import anchors

pytestmark = needs_kubectl
SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")


def exported_names() -> set[str]:
    source = ROOT / "specserve"
    orchestrator = (source / "orchestrator/metrics.py").read_text()
    replicas = (source / "serving/metrics.py").read_text()
    http = (source / "openai_api/metrics.py").read_text()
    bases = {f"specserve_orchestrator_{n}" for n in re.findall(r'f"\{P\}_(\w+)"', orchestrator)}
    bases |= {f"specserve_http_{n}" for n in re.findall(r'f"\{P\}_(\w+)"', http)}
    bases |= {f"specserve_orchestrator_{r}_replicas_up" for r in ("draft", "target")}
    for pool in ("draft", "target"):
        bases |= {f"specserve_{pool}_{n}" for n in re.findall(r'f"\{p\}_(\w+)"', replicas)}
    return {b + s for b in bases for s in SUFFIXES}


def rules() -> list[Doc]:
    (rule,) = by_kind(render(K8S / "monitoring"), "PrometheusRule").values()
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def unknown_series(rules: list[Doc], known: set[str]) -> list[str]:
    return [
        f"{r['alert']}: {name}"
        for r in rules
        for name in re.findall(r"specserve_\w+", r["expr"])
        if name not in known
    ]


def test_every_alert_reads_exported_series() -> None:
    found = rules()
    assert len(found) >= 5
    assert unknown_series(found, exported_names()) == []


def test_a_misspelt_series_would_be_caught() -> None:
    bad = [{"alert": "X", "expr": "rate(specserve_orchestrator_slow_verify_total[5m]) > 0"}]
    assert unknown_series(bad, exported_names()) == ["X: specserve_orchestrator_slow_verify_total"]


def test_every_alert_has_a_runbook_section() -> None:
    sections = anchors(ROOT / "docs/runbook.md")
    for rule in rules():
        path, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert path == "docs/runbook.md" and anchor in sections, rule["alert"]


def test_every_alert_is_complete() -> None:
    for rule in rules():
        assert re.fullmatch(r"Specserve[A-Z]\w+", rule["alert"]), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s")), rule["alert"]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]


def test_every_deployed_process_has_an_alert() -> None:
    series = " ".join(r["expr"] for r in rules())
    for prefix in ("specserve_orchestrator_", "specserve_target_", "specserve_draft_"):
        assert prefix in series, prefix
    assert "specserve_http_" in series  # the OpenAI-compatible door (k8s/base/http-server.yaml)
