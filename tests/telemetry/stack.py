"""A traced stack for the telemetry tests: target, draft and orchestrator processes
exporting spans to a receiver this process runs, each serving ``/metrics``.

The orchestrator uses the embedded store (fakeredis), so the Redis instrumentation
is exercised without a Redis server.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass, field

from specserve.orchestrator.launch import OrchestratorProcess
from specserve.serving.launch import ServerProcess
from specserve.telemetry.receiver import ReceivedSpan, TraceReceiver
from tests.orchestrator.redis_server import free_port
from tests.orchestrator.stack import ENV

TARGET = "tiny:3"
DRAFT = "tiny:3:noise=0.3"
MODEL_NAME = "tiny-served"
SERVER_ARGS = ["--threads", "1", "--kv-budget", "8MiB"]


@dataclass
class TracedStack:
    receiver: TraceReceiver = field(default_factory=TraceReceiver)
    procs: dict[str, ServerProcess] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)

    def start(self) -> TracedStack:
        self.receiver.start()
        env = {**ENV, **self.receiver.env()}
        self.metrics_ports = {role: free_port() for role in ("target", "draft", "orchestrator")}
        for role, model in (("target", TARGET), ("draft", DRAFT)):
            port = str(self.metrics_ports[role])
            args = ["--model", model, *SERVER_ARGS, "--metrics-port", port]
            self.procs[role] = ServerProcess(role, args, env=env).start()
        self.procs["orchestrator"] = OrchestratorProcess(
            [
                "--target",
                self.procs["target"].address,
                "--draft",
                self.procs["draft"].address,
                "--served-model-name",
                MODEL_NAME,
                "--metrics-port",
                str(self.metrics_ports["orchestrator"]),
                "--log-format",
                "json",
            ],
            env=env,
        ).start()
        for p in self.procs.values():
            p.wait_serving()
        # The orchestrator pings its store at start: once that span is in, nothing from
        # start-up can arrive later and mix with a test's trace.
        self.receiver.wait_for(lambda spans: any(s.name == "PING" for s in spans))
        return self

    def stop(self) -> None:
        for role in ("orchestrator", "draft", "target"):
            if role in self.procs:
                self.procs[role].stop()
        self.receiver.stop()

    @property
    def address(self) -> str:
        return self.procs["orchestrator"].address

    def scrape(self, role: str) -> dict[str, float]:
        """Every sample of a process's /metrics, keyed by name and label text."""
        url = f"http://127.0.0.1:{self.metrics_ports[role]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            body = r.read().decode()
        out = {}
        for m in re.finditer(r"^(specserve_\w+)(\{[^}]*\})? (\S+)$", body, re.M):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def trace_of(self, trace_id: str, spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.trace_id == trace_id]
